"""The engine worker is spawned before the server imports torch, and it reads the model's spec
(importing what that needs) while the plan is resolved (core.frontend.prestart; issue 37's
start-up). Each case runs in a fresh interpreter: this one has torch imported already."""

from __future__ import annotations

import json
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
            def __init__(self, args=None):
                print("torch" in sys.modules, args.model_path)
                raise Seen()

        prestart.StartedWorker = Probe
        from core.cli import main
        try:
            main(["serve", "--model-path", {str(LLAMA)!r}, "--dp-size", "2"])
        except Seen:
            print("spawned")
    """)
    assert lines[-2:] == [f"False {LLAMA}", "spawned"]


def test_a_prestarted_worker_reads_the_model_before_the_plan_comes(tmp_path):
    # the parent end closed: the worker warms up, finds no plan and returns. The first time it
    # builds the spec, the config and the tokenizer through transformers and caches them; a
    # restart reads them from the cache and imports no transformers at all
    from model_fixtures import write_config_model

    model = tmp_path / "model"
    write_config_model(model, json.loads(LLAMA.read_text()))
    cache = tmp_path / "cache"
    code = f"""
        import multiprocessing, os, sys
        os.environ["CORE_GGUF_CACHE"] = {str(cache)!r}
        from core.engine.worker import args_to_json, worker_prestarted
        from core.plan.args import make_server_args
        parent, child = multiprocessing.Pipe()
        parent.close()
        args = make_server_args(model_path={str(model)!r}, load_format="dummy")
        worker_prestarted(child, args_to_json(args))
        import core.plan.registry as r
        print("transformers" in sys.modules, r._cached is not None)
        print(sorted(p.name.split("-")[0] for e in os.listdir({str(cache)!r})
                     for p in __import__("pathlib").Path({str(cache)!r}, e).iterdir()
                     if not p.name.startswith(".")))  # lock files
    """
    first = _run(code)
    assert first[-2] == "True True"
    assert first[-1] == "['config', 'spec', 'tokenizer']"
    assert _run(code)[-2:] == ["False True", first[-1]]  # the restart

def test_a_warm_up_that_fails_is_silent_and_the_worker_still_waits_for_its_plan():
    # a model path that does not exist: the failure is the plan's to report, not the warm-up's
    lines = _run("""
        import multiprocessing
        from core.engine.worker import worker_prestarted
        parent, child = multiprocessing.Pipe()
        parent.close()
        from core.engine.worker import args_to_json
        from core.plan.args import make_server_args
        worker_prestarted(child, args_to_json(make_server_args(model_path="/nonexistent/m")))
        print("returned")
    """)
    assert lines[-1] == "returned"
