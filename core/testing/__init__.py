"""Deprecated: the conformance kit moved out of core to the top-level package `conformance`.

`core.testing` is only an alias now, kept for one release: it goes in core-serve 0.2.0. Import
from `conformance` instead (same module names), and load the pytest plugin as
`-p conformance.plugin` (the pytest11 entry point's new name):

    core.testing.<module>       ->  conformance.<module>   (attention_suite, moe_suite, quant_refs...)
    core.testing.conformance    ->  conformance.plugin     (the pytest plugin)

Every `core.testing.X` is the very module object `conformance.X` (`conformance.plugin` for
`core.testing.conformance`), not a copy: a finder on sys.meta_path hands the import system the
module already imported under its new name, when first asked for, so importing this package
imports no suite (nor torch). The plugin, loaded under both names (its entry point and an old
`-p core.testing.conformance`), registers once (conformance/plugin.py, pytest_plugin_registered).
Nothing in core imports `conformance`; this alias does, by name, only when it is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

NEW = "conformance"
RENAMED = {"conformance": "plugin"}  # core.testing.<old> -> conformance.<new>; the rest keep names

warnings.warn(f"{__name__} is deprecated and goes in core-serve 0.2.0: import from `{NEW}` "
              f"(`{NEW}.plugin` for the pytest plugin {__name__}.conformance)",
              DeprecationWarning, stacklevel=2)


def _target(fullname: str) -> str | None:
    """`conformance.X` for `core.testing.X` (one level: the kit has no subpackages)."""
    head, _, child = fullname.rpartition(".")
    if head != __name__ or not child:
        return None
    return f"{NEW}.{RENAMED.get(child, child)}"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `core.testing.X` as the module `conformance.X`, importing that one."""

    def find_spec(self, fullname, path=None, target=None):
        new = _target(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self)
        spec.loader_state = {"target": new}
        return spec

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state["target"])
        spec.loader_state["spec"] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Between create_module and here the import system stamps the alias's spec on the
        # module; give it back its own. Nothing to execute: it ran under its own name.
        module.__spec__ = module.__spec__.loader_state["spec"]


if not any(type(f).__name__ == "_AliasFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str) -> ModuleType:
    """`core.testing.attention_suite` as an attribute of the package, as after an import."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
