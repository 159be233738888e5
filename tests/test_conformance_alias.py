"""The conformance kit moved from core/testing/ to the top-level package conformance/; until 0.2
`core.testing` stays an alias (core/testing/__init__.py). Every old name gives the very module
object of the new one, and the pytest plugin registers once whether pytest finds it through its
entry point (`conformance.plugin`), an old `-p core.testing.conformance`, or both."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import conformance

REPO = Path(__file__).resolve().parent.parent
MODULES = sorted(m.name for m in pkgutil.iter_modules(conformance.__path__))


def test_the_kit_left_core():
    assert (REPO / "conformance" / "plugin.py").is_file()
    assert [p.name for p in (REPO / "core" / "testing").glob("*.py")] == ["__init__.py"]
    importers = [str(p.relative_to(REPO)) for p in (REPO / "core").rglob("*.py")
                 if p.parent.name != "testing"
                 and re.search(r"^\s*(from|import)\s+conformance\b", p.read_text(), re.M)]
    assert not importers, f"core imports the conformance kit: {importers}"


@pytest.mark.parametrize("name", MODULES)
def test_each_old_name_is_the_new_module(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import core.testing
        old = importlib.import_module(f"core.testing.{'conformance' if name == 'plugin' else name}")
    new = importlib.import_module(f"conformance.{name}")
    assert old is new
    assert new.__name__ == new.__spec__.name == f"conformance.{name}"  # its own spec kept
    assert getattr(core.testing, "conformance" if name == "plugin" else name) is new


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_the_alias_is_lazy_warns_and_keeps_import_forms():
    proc = _python(
        "import sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import core.testing\n"
        "assert [str(x.category.__name__) for x in w] == ['DeprecationWarning'], w\n"
        "assert '0.2.0' in str(w[0].message) and w[0].filename == '<string>', w[0]\n"
        "assert 'torch' not in sys.modules and 'conformance.plugin' not in sys.modules\n"
        "from core.testing.conformance import named_plugins, SUITES\n"
        "import core.testing.conformance as a, conformance.plugin as b\n"
        "from core.testing import conformance as c\n"
        "assert a is b is c and named_plugins is b.named_plugins\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    import core.testing.no_such_suite\n"
        "except ModuleNotFoundError as e:\n"
        "    assert e.name == 'core.testing.no_such_suite', e.name\n"
        "else:\n"
        "    raise AssertionError('imported a module that does not exist')\n")
    assert proc.returncode == 0, proc.stderr


PROBE = '''
import sys

def test_probe(pytestconfig):
    pm = pytestconfig.pluginmanager
    mod = sys.modules.get("conformance.plugin")
    names = [n for n, p in pm.list_name_plugin() if mod is not None and p is mod]
    print("REGISTERED", names, pytestconfig.getoption("conformance_seed", default=None))
'''


@pytest.fixture()
def project(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    return tmp_path


def _pytest(project: Path, *args: str, autoload: bool = True, conftest: str = "",
            old_entry_point: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """pytest in a folder of its own (core-serve as installed: the entry point needs its
    metadata); `old_entry_point` adds a distribution that still declares the old name."""
    env = dict(os.environ)
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        env.pop(name, None)
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if conftest:
        (project / "conftest.py").write_text(conftest)
    if old_entry_point:  # e.g. core-serve's metadata from before the move, left on the path
        info = project / "site" / "old_kit-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: old-kit\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[pytest11]\ncore.testing.conformance = core.testing.conformance\n")
        env["PYTHONPATH"] = os.pathsep.join([str(project / "site"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
                           *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)
    m = re.search(r"^REGISTERED (.*)$", proc.stdout, re.M)
    return proc, m.group(1) if m else ""


@pytest.mark.parametrize(("args", "autoload", "conftest", "registered"), [
    ((), True, "", "['conformance.plugin'] 0"),  # the entry point alone
    (("-p", "core.testing.conformance"), True, "", "['core.testing.conformance'] 0"),
    (("-p", "conformance.plugin"), True, "", "['conformance.plugin'] 0"),
    (("-p", "core.testing.conformance", "-p", "conformance.plugin"), True, "",
     "['core.testing.conformance'] 0"),
    (("-p", "conformance.plugin", "-p", "core.testing.conformance"), True, "",
     "['conformance.plugin'] 0"),
    (("-p", "core.testing.conformance"), False, "", "['core.testing.conformance'] 0"),
    ((), True, 'pytest_plugins = ["core.testing.conformance"]\n', "['conformance.plugin'] 0"),
    ((), False, 'pytest_plugins = ["core.testing.conformance"]\n',
     "['core.testing.conformance'] 0"),
    (("-p", "no:core.testing.conformance"), True, "", "[] None"),
    (("-p", "no:conformance.plugin"), True, "", "[] None"),
    ((), "old-entry-point", "", "['core.testing.conformance'] 0"),
    (("-p", "conformance.plugin"), "old-entry-point", "", "['conformance.plugin'] 0"),
], ids=["entry-point", "old-p", "new-p", "old-then-new-p", "new-then-old-p", "old-p-no-autoload",
        "conftest-old-name", "conftest-old-name-no-autoload", "disabled-by-old-name",
        "disabled-by-new-name", "both-entry-points", "both-entry-points-new-p"])
def test_the_plugin_registers_once_under_either_name(project, args, autoload, conftest,
                                                     registered):
    """Once, under the name pytest met first (a `-p` before the entry points; the entry points
    in sys.path order), with its options; `-p no:` under either name turns it off."""
    proc, got = _pytest(project, *args, autoload=bool(autoload), conftest=conftest,
                        old_entry_point=autoload == "old-entry-point")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert got == registered, proc.stdout + proc.stderr


def test_backend_shorthand_comes_with_either_p_name(project):
    """`--backend` (the shorthand that exists only when the plugin is asked for with -p) under
    the old name as under the new; options once each (a duplicate would be a ValueError)."""
    for name in ("core.testing.conformance", "conformance.plugin"):
        proc, _ = _pytest(project, "-p", name, "--help")
        assert proc.returncode == 0, proc.stderr
        assert len(re.findall(r"^\s+--backend=NAME", proc.stdout, re.M)) == 1, proc.stdout
        assert len(re.findall(r"^\s+--conformance-backend=NAME", proc.stdout, re.M)) == 1
    proc, _ = _pytest(project, "--help")
    assert "--conformance-backend=NAME" in proc.stdout and "--backend=NAME" not in proc.stdout
