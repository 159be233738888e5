"""The folder rules of the layout (ARCHITECTURE.md), read from the source:

- plugins import from core only core.contract and core.layers;
- a plugin package imports from plugins only itself and plugins._kit (the shared helpers);
- core/engine/ never imports core.frontend or core.server;
- core/frontend/ never imports core.server;
- core/plan/ imports no torch (checked by importing every module of it in a fresh interpreter);
- core.messages, core/server/ and the server's test kit import no torch (the same way);
- core's modules import one another without a cycle (module-level imports).

Every rule holds without exceptions: a file that breaks one is fixed, not listed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The absolute module names `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks do not run
        nodes = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package
                here = _module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _core_modules() -> set[str]:
    return {_module_name(p) for p in _files("core")}


def _bad_plugin_imports(path: Path, core_mods: set[str]) -> set[str]:
    return {m for m in _imports(path) if m in core_mods
            and not m.startswith(("core.contract", "core.layers"))}


def _plugin_violations() -> dict[str, set[str]]:
    core_mods = _core_modules() | {"core"}
    found = {str(p.relative_to(ROOT)): _bad_plugin_imports(p, core_mods)
             for p in _files("plugins")}
    return {f: m for f, m in found.items() if m}


def test_plugins_import_only_the_contract_and_the_layers():
    found = _plugin_violations()
    assert not found, found


KIT = "plugins._kit"


def _plugin_package(module: str) -> str:
    """The plugin package of a module under plugins/: plugins.<kind>.<name> where that is a
    folder (plugins.attention.cpu_c, plugins.quant.int4), else the kind's folder, whose
    one-module plugins share it (plugins.models, plugins.hardware); the kit is plugins._kit."""
    parts = module.split(".")
    if len(parts) >= 3 and ROOT.joinpath(*parts[:3]).is_dir():
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def _cross_plugin_imports(path: Path) -> set[str]:
    own = _plugin_package(_module_name(path))
    return {m for m in _imports(path) if m.split(".")[0] == "plugins"
            and _plugin_package(m) not in (own, KIT)}


def test_plugin_packages_share_code_only_through_the_kit():
    found = {str(p.relative_to(ROOT)): sorted(m) for p in _files("plugins")
             if (m := _cross_plugin_imports(p))}
    assert not found, found


def test_the_engine_never_imports_the_frontend_or_the_server():
    found = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                              if m.startswith(("core.frontend", "core.server")))
             for p in _files("core/engine")}
    found = {f: m for f, m in found.items() if m}
    assert not found, found


def test_the_frontend_never_imports_the_server():
    """The client side of the engine serves the offline Engine and any server alike: what it
    refuses is a core.frontend.refusal.Refused, which the HTTP server turns into its answer."""
    found = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                              if m.startswith("core.server"))
             for p in _files("core/frontend")}
    found = {f: m for f, m in found.items() if m}
    assert not found, found


def test_the_plan_imports_no_torch():
    mods = sorted(_module_name(p) for p in _files("core/plan"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'transformers', 'triton') "
            "if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(mods) >= 10


def test_the_process_boundary_and_the_http_layer_import_no_torch():
    """core.messages (the pipe's vocabulary, SamplingParams included), the server's modules and
    its test kit load without torch: the HTTP process needs torch only for what the engine
    client starts."""
    mods = ["core.messages", "core.frontend.delta", "core.frontend.serving",
            "conformance.server_kit",
            *sorted(_module_name(p) for p in _files("core/server"))]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_core_modules_import_one_another_without_a_cycle():
    mods = _core_modules()
    graph = {}
    for path in _files("core"):
        name = _module_name(path)
        deps = set()
        for m in _imports(path, top_level_only=True):
            while m and m not in mods:  # `from core.x import Name` -> core.x
                m = m.rpartition(".")[0]
            if m and m != name and not name.startswith(m + "."):  # a package's own __init__
                deps.add(m)
        graph[name] = deps
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [n, d])
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_the_plugin_rule_catches_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from core.engine.scheduler import Scheduler\nimport core.frontend.client\n"
                   "from core.contract.attention import AttentionBackend\n")
    assert _bad_plugin_imports(bad, _core_modules()) == {"core.engine.scheduler",
                                                         "core.frontend.client"}


def test_the_plugin_package_rule_catches_what_it_forbids(tmp_path, monkeypatch):
    backend = tmp_path / "plugins" / "attention" / "cpu_c" / "backend.py"
    backend.parent.mkdir(parents=True)
    (tmp_path / "plugins" / "attention" / "torch_native").mkdir()
    (tmp_path / "plugins" / "quant" / "int4").mkdir(parents=True)  # quant/common.py: a module
    backend.write_text("from plugins.attention.torch_native.backend import TorchNativeMeta\n"
                       "from plugins.quant.common import parameter\n"
                       "from . import kernels\n"
                       "from plugins.attention.cpu_c.kernels import decode\n"
                       "from plugins._kit.pool_attention import PoolDecodeAttention\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _cross_plugin_imports(backend) == {
        "plugins.attention.torch_native.backend",
        "plugins.attention.torch_native.backend.TorchNativeMeta",
        "plugins.quant.common", "plugins.quant.common.parameter"}
