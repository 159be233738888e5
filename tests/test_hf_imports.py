"""core.plan.hf_imports: the `core` command and the engine worker processes hide torchvision
before transformers is imported (transformers' config validation imports torchvision, and it
torch._dynamo: ~5 s a process on the H100 image); a library user's process keeps it. A fake
torchvision package on the path stands in for the real one (none is installed here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_torchvision(tmp_path: Path) -> Path:
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.99.0'\n")
    meta = tmp_path / "torchvision-0.99.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\n")
    return tmp_path


def _run(code: str, path: Path, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "CORE_TORCHVISION"}
    full.update(PYTHONPATH=os.pathsep.join([str(path), str(ROOT)]), **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=full, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


HIDDEN = """
    import importlib.util, sys
    hidden = importlib.util.find_spec("torchvision") is None
    try:
        import torchvision  # noqa: F401
        imported = True
    except ImportError:
        imported = False
    print(hidden, imported)
"""


def test_the_core_command_hides_torchvision(fake_torchvision):
    code = "from core.cli import main\nassert main(['backends']) == 0\n"
    assert _run(code + textwrap.dedent(HIDDEN), fake_torchvision) == "True False"


def test_an_engine_worker_hides_torchvision(fake_torchvision):
    code = """
        import multiprocessing
        from core.engine.worker import worker_prestarted
        parent, child = multiprocessing.Pipe()
        parent.close()
        worker_prestarted(child)  # the parent is gone: it returns once torch is imported
    """
    assert _run(textwrap.dedent(code) + textwrap.dedent(HIDDEN), fake_torchvision) == "True False"


def test_a_library_process_and_the_opt_out_keep_torchvision(fake_torchvision):
    code = "import core.frontend.offline\n" + textwrap.dedent(HIDDEN)
    assert _run(code, fake_torchvision) == "False True"
    code = "from core.cli import main\nassert main(['backends']) == 0\n"
    assert _run(code + textwrap.dedent(HIDDEN), fake_torchvision,
                CORE_TORCHVISION="1") == "False True"
