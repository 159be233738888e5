"""A plugin package as `pip install --target` leaves it: the package and its dist-info (with the
`core.plugins` entry point) in a site folder, which PYTHONPATH makes importable and discoverable
by importlib.metadata, in this process's children as in a third party's own project."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# what could make a child pytest load other plugins than the ones a test names
ISOLATING_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
                 "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY", "CORE_STRICT_PLUGINS")


def install(site: Path, module: str, source: str) -> Path:
    """Write package `module` (its __init__ is `source`, dedented) and its dist-info, whose
    `core.plugins` entry point `module` names it, into `site`; returns `site`."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    name = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[core.plugins]\n{module} = {module}\n")
    return site


def child_env(site: Path) -> dict[str, str]:
    """This environment for a child that finds the package in `site` and this checkout, with
    nothing else steering which plugins load."""
    env = dict(os.environ)
    for name in ISOLATING_ENV:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    return env
