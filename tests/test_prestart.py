"""The engine worker is spawned before the server imports torch, and it reads the model's spec
(importing what that needs) while the plan is resolved (core.frontend.prestart; issue 37's
start-up). Each case runs in a fresh interpreter: this one has torch imported already."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"


def _run(code: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_core_serve_spawns_its_workers_before_it_imports_torch():
    # StartedWorker replaced by one that reports what the server had imported when it came
    # (and stops the command there): torch must not be among it, the model path must be passed
    lines = _run(f"""
        import sys
        import core.frontend.prestart as prestart

        class Seen(Exception):
            pass

        class Probe:
            def __init__(self, warm_path=None):
                print("torch" in sys.modules, warm_path)
                raise Seen()

        prestart.StartedWorker = Probe
        from core.cli import main
        try:
            main(["serve", "--model-path", {str(LLAMA)!r}, "--dp-size", "2"])
        except Seen:
            print("spawned")
    """)
    assert lines[-2:] == [f"False {LLAMA}", "spawned"]


def test_a_prestarted_worker_reads_the_model_config_before_the_plan_comes(tmp_path):
    # the parent end closed: the worker warms up, finds no plan and returns. The first time it
    # builds the spec and the config through transformers and caches them by config.json; a
    # restart reads both from the cache and imports no transformers at all
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(LLAMA.read_text())
    cache = tmp_path / "cache"
    code = f"""
        import multiprocessing, os, sys
        os.environ["CORE_GGUF_CACHE"] = {str(cache)!r}
        from core.engine.worker import worker_prestarted
        parent, child = multiprocessing.Pipe()
        parent.close()
        worker_prestarted(child, {str(model)!r})
        import core.plan.registry as r
        print("transformers" in sys.modules, r._cached is not None)
        print(sorted(p.name.split("-")[0] for e in os.listdir({str(cache)!r})
                     for p in __import__("pathlib").Path({str(cache)!r}, e).iterdir()))
    """
    first = _run(code)
    assert first[-2] == "True True"
    assert first[-1] == "['config', 'spec']"
    assert _run(code)[-2:] == ["False True", first[-1]]  # the restart

def test_a_warm_up_that_fails_is_silent_and_the_worker_still_waits_for_its_plan():
    # a model path that does not exist: the failure is the plan's to report, not the warm-up's
    lines = _run("""
        import multiprocessing
        from core.engine.worker import worker_prestarted
        parent, child = multiprocessing.Pipe()
        parent.close()
        worker_prestarted(child, "/nonexistent/model")
        print("returned")
    """)
    assert lines[-1] == "returned"
