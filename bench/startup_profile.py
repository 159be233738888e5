"""Where the engine's start-up time goes on the default model (a diagnostic, not a benchmark).

    python bench/startup_profile.py                   # stages, 3 fresh processes each
    python bench/startup_profile.py --importtime      # + the heaviest imports of each side
    python bench/startup_profile.py --profile 25      # + cProfile's top 25 of each side

Every figure comes from a fresh Python process (this script with --child MODE), so nothing is
warm in the interpreter; the GGUF conversion cache (core.plan.gguf_cache) is warm, as on every start
but the first. Three views:
- `engine`: `core.Engine()` as bench/bench_cpu_peers.py's load stage times it (torch and `core`
  imported first and not counted; the engine worker spawned inside is counted), with the
  client's stages: import of core.frontend.offline, make_plan, the tokenizer, and the wait for the
  worker's Ready after the plan was sent;
- `worker`: what the spawned worker does, replayed in one process with a clock on each stage:
  its imports (core.engine.worker.worker_prestarted's), plan_from_parent, then build_engine_core's
  load (config, model, weights, tokenizer) and the rest (KV pool, runner, scheduler);
- `modules`: whether transformers (and other heavy modules) got imported by the client's
  make_plan + tokenizer, and by the worker's build.
--importtime runs each side under `python -X importtime` and prints the imports with the most
cumulative time; --profile runs cProfile over the client's Engine() and the worker's build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine_info import cpu_model

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("transformers", "torch", "numpy", "gguf", "jinja2", "tokenizers", "aiohttp",
         "jsonschema", "numba", "triton", "xgrammar", "llguidance", "outlines", "safetensors",
         "sympy", "scipy", "pydantic", "tqdm")


def _median_of(seconds: list[float]) -> str:
    """'median X s (runs: a, b, ...)' of fresh-process timings."""
    return (f"median {statistics.median(seconds):.3f} s (runs: "
            f"{', '.join(f'{x:.2f}' for x in seconds)})")


# -- the children ---------------------------------------------------------------------------------

def _clock() -> Any:
    t0 = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        marks[name] = round(now - t0, 4)
        t0 = now

    return marks, mark


def _wrap(module: Any, name: str, marks: dict[str, float]) -> None:
    """Time every call of module.name into marks[name] (summed)."""
    fn = getattr(module, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            marks[name] = round(marks.get(name, 0.0) + time.perf_counter() - t, 4)

    setattr(module, name, timed)


def child_engine(dtype: str, profile: int, extra: dict[str, Any]) -> dict[str, Any]:
    import torch

    import core
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    marks: dict[str, float] = {}
    t = time.perf_counter()
    import core.engine.worker as wk
    import core.frontend.offline as eng
    marks["import core.frontend.offline"] = round(time.perf_counter() - t, 4)
    _wrap(wk, "make_plan", marks)
    _wrap(eng, "_load_tokenizer", marks)
    from core.frontend import client as cl

    original_wait = cl.EngineClient._wait_ready

    def wait_ready(self: Any, timeout: float) -> Any:
        t = time.perf_counter()
        try:
            return original_wait(self, timeout)
        finally:
            marks["worker ready after the plan was sent"] = round(time.perf_counter() - t, 4)

    cl.EngineClient._wait_ready = wait_ready
    modules_before = {m for m in HEAVY if m in sys.modules}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    engine = core.Engine(None, dtype=dtype, device="cpu", max_total_tokens=8192, **extra)
    total = time.perf_counter() - t + marks["import core.frontend.offline"]
    if prof is not None:
        prof.disable()
    try:
        out = engine.generate("The capital of France is",
                              {"max_new_tokens": 4, "temperature": 0.0})
    finally:
        engine.close()
    res = {"load_s": round(total, 4), "stages": marks,
           "plan": f"{engine.plan.quant_method} / {engine.plan.decode_attention}",
           "generated": out["text"],
           "imported_by_engine": sorted(m for m in HEAVY if m in sys.modules
                                        and m not in modules_before)}
    if prof is not None:
        res["profile"] = _top(prof, profile)
    return res


def child_plan(dtype: str) -> dict[str, Any]:
    """The args and plan JSON a client sends its worker (for the `worker` view)."""
    import core.engine.worker as wk
    from core.plan.args import make_server_args

    args, plan, _, _ = wk.make_plan(make_server_args(dtype=dtype, device="cpu",
                                                     max_total_tokens=8192))
    return {"args": wk.args_to_json(args), "plan": wk.plan_to_json(plan)}


class _TimedConn:
    """The worker's end of its pipe, which notes when the worker first reads (its imports are
    done then) and wraps the build's stages in clocks at that moment."""

    def __init__(self, conn: Any, marks: dict[str, float], t0: float):
        self._conn, self._marks, self._t0, self._read = conn, marks, t0, False

    def recv_bytes(self, *a: Any) -> Any:
        if not self._read:
            self._read = True
            self._marks["worker imports (torch, core.engine.worker, core.engine.loader, ...)"] = round(
                time.perf_counter() - self._t0, 4)
            import core.engine.loader as ld
            import core.engine.worker as wk

            for name in ("load_config", "count_and_iter_weights", "_load_tokenizer",
                         "load_model"):
                _wrap(ld, name, self._marks)
            for name in ("plan_from_parent", "build_engine_core"):
                _wrap(wk, name, self._marks)
        return self._conn.recv_bytes(*a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def child_worker(dtype: str, profile: int, plan_file: str) -> dict[str, Any]:
    """core.engine.worker.worker_prestarted as the spawned worker runs it, in this process (the main
    thread), fed the plan through a pipe; a thread takes its Ready and shuts it down."""
    import multiprocessing as mp
    import threading

    message = Path(plan_file).read_bytes()
    marks: dict[str, float] = {}
    parent, child = mp.Pipe(duplex=True)
    parent.send_bytes(message)  # sent ahead: the worker reads it once its imports are done
    t0 = time.perf_counter()
    got: dict[str, Any] = {}

    def client() -> None:
        while True:  # heartbeats may come first
            kind = json.loads(parent.recv_bytes().decode()).get("type")
            if kind in ("ready", "fatal"):
                break
        got["ready_s"] = round(time.perf_counter() - t0, 4)
        got["reply"] = kind
        parent.send_bytes(json.dumps({"type": "shutdown"}).encode())

    before = {m for m in HEAVY if m in sys.modules}
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    from core.engine.worker import worker_prestarted  # noqa: E402  (timed: the worker imports it)

    worker_prestarted(_TimedConn(child, marks, t0))
    if prof is not None:
        prof.disable()
    thread.join(timeout=30)
    res = {"ready_s": got.get("ready_s"), "reply": got.get("reply"), "stages": marks,
           "imported": sorted(m for m in HEAVY if m in sys.modules and m not in before)}
    if prof is not None:
        res["profile"] = _top(prof, profile)
    return res


def child_client_modules() -> dict[str, Any]:
    """What the client's make_plan and tokenizer import, beyond torch and core.frontend.offline."""
    import torch  # noqa: F401

    import core.frontend.offline  # noqa: F401
    from core.engine.worker import make_plan
    from core.frontend.offline import _load_tokenizer
    from core.plan.args import make_server_args

    before = set(sys.modules)
    marks, mark = _clock()
    args, plan, _, _ = make_plan(make_server_args(device="cpu"))
    mark("make_plan")
    tok = _load_tokenizer(args)
    mark("tokenizer")
    ids = tok.encode("Hello, world! <|im_start|>")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    mark("encode + chat template")
    return {"stages": marks, "ids": ids, "chat": text,
            "heavy": sorted(m for m in HEAVY if m in sys.modules and m not in before)}


def _top(prof: Any, n: int) -> list[str]:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][:n + 8]


# -- the parent -----------------------------------------------------------------------------------

def run_child(mode: str, a: argparse.Namespace, profile: int = 0,
              importtime: bool = False) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), __file__,
           "--child", mode, "--dtype", a.dtype, "--profile", str(profile),
           *(x for kv in a.set for x in ("--set", kv)),
           *(["--plan-file", a.plan_file] if getattr(a, "plan_file", None) else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    if done.returncode:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-4000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT ")), done.stderr


def heaviest_imports(stderr: str, n: int) -> list[str]:
    """The n imports with the most cumulative time, from -X importtime's lines."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        try:
            _, cum, name = (x.strip() for x in line.removeprefix("import time:").split("|"))
            rows.append((int(cum), name))
        except ValueError:
            continue
    rows.sort(reverse=True)
    return [f"{cum / 1e6:7.3f} s  {name}" for cum, name in rows[:n]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="fresh processes per view")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--importtime", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--top", type=int, default=25, help="imports listed per side")
    p.add_argument("--views", default="engine,worker,client",
                   help="comma-separated subset of engine, worker, client")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a ServerArgs field for core.Engine() in the engine view (a string), "
                   "e.g. --set grammar_backend=none")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan-file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        extra = dict(kv.split("=", 1) for kv in a.set)
        fn = {"engine": lambda: child_engine(a.dtype, a.profile, extra),
              "worker": lambda: child_worker(a.dtype, a.profile, a.plan_file),
              "plan": lambda: child_plan(a.dtype),
              "client_modules": child_client_modules}[a.child]
        print("RESULT " + json.dumps(fn()), flush=True)
        return 0

    report: dict[str, Any] = {"machine": {"cpu": cpu_model(), "loadavg_1m":
                                          round(os.getloadavg()[0], 2)}}
    views = a.views.split(",")
    if "worker" in views:
        plan_msg, _ = run_child("plan", a)
        plan_file = Path(tempfile.mkdtemp(prefix="startup-")) / "plan.json"
        plan_file.write_text(json.dumps(plan_msg))
        a.plan_file = str(plan_file)
    for mode in [v for v in ("engine", "worker") if v in views]:
        runs = [run_child(mode, a)[0] for _ in range(a.reps)]
        report[mode] = runs
        stages: dict[str, list[float]] = {}
        for r in runs:
            for k, v in r["stages"].items():
                stages.setdefault(k, []).append(v)
        print(f"\n== {mode} (median of {a.reps} fresh processes)")
        if mode == "engine":
            print(f"  core.Engine() incl. import of core.frontend.offline: "
                  f"{_median_of([r['load_s'] for r in runs])}")
            print(f"  plan: {runs[0]['plan']}; generated: {runs[0]['generated']!r}")
            print(f"  heavy modules the Engine() imported: {runs[0]['imported_by_engine']}")
        for k, vs in stages.items():
            print(f"  {k:45s} {statistics.median(vs):7.3f} s")
        if mode == "worker":
            print(f"  start to Ready: {_median_of([r['ready_s'] for r in runs])}; "
                  f"reply {runs[0]['reply']}")
            print(f"  heavy modules the worker imported: {runs[0]['imported']}")
    if "client" in views:
        mods, _ = run_child("client_modules", a)
        report["client_modules"] = mods
        print("\n== client: make_plan + tokenizer\n  "
              + "\n  ".join(f"{k:45s} {v:7.3f} s" for k, v in mods["stages"].items()))
        print(f"  heavy modules they import: {mods['heavy']}")
    if a.importtime:
        for mode in ("client_modules", "worker"):
            _, err = run_child(mode, a, importtime=True)
            top = heaviest_imports(err, a.top)
            report[f"importtime_{mode}"] = top
            print(f"\n== -X importtime, {mode} (cumulative)\n  " + "\n  ".join(top))
    if a.profile:
        for mode in ("engine", "worker"):
            res, _ = run_child(mode, a, profile=a.profile)
            report[f"profile_{mode}"] = res["profile"]
            print(f"\n== cProfile, {mode}\n" + "\n".join(res["profile"]))
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
