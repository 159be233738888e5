"""One chat request's path through the modules, measured: which calls cross from one project
module to another, and how many output shapes carry its tokens back.

    python bench/call_path.py [--model-path P] [--max-tokens 2] [--json]

Two traces, both with sys.setprofile (Python calls only; C functions are not counted):

- the HTTP process: the aiohttp app (core.server) over the real engine client
  (core.frontend), one non-streamed /v1/chat/completions request, every thread of the process
  traced while it runs. The worker is another process, so what it does is not seen here.
- the worker: the same engine core built in this process (core.engine.worker.build_engine_core)
  given the request as the worker gets it (an AddRequest through the message codec) and stepped
  until it finishes, each step's outputs encoded as the worker sends them. The model's forward
  counts as one call into it (what runs inside it, layers and kernel plugins, is not the
  request's path).

A "crossing" is a call whose caller and callee are in different modules of the project (core/,
plugins/); the report lists each distinct (caller module, callee module) pair once, in the
order first seen, with how many calls took it. Outputs shapes: the types that carry the
request's new tokens from the sampler to the response body, read off the same traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROJECT = ("core", "plugins", "conformance")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def module_of(frame: FrameType) -> str | None:
    """The project module a frame runs in (None: not the project's)."""
    name = frame.f_globals.get("__name__", "")
    return name if name.split(".")[0] in PROJECT else None


class Tracer:
    """Counts module-crossing calls between project modules while `on`. A call into a plugin
    (plugins.*: the model, a kernel, the platform) counts; what runs inside it is not
    followed. Installed on every thread started after `install()` and on this one."""

    def __init__(self) -> None:
        self.pairs: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.examples: dict[tuple[str, str], str] = {}
        self._opaque: dict[int, int] = {}  # thread id -> depth inside an opaque call
        self.lock = threading.Lock()
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        tid = threading.get_ident()
        depth = self._opaque.get(tid, 0)
        if event == "return":
            if depth:
                self._opaque[tid] = depth - 1
            return
        if depth:
            self._opaque[tid] = depth + 1
            return
        callee = module_of(frame)
        caller = module_of(frame.f_back) if frame.f_back is not None else None
        if callee and caller and callee != caller:
            key = (caller, callee)
            with self.lock:
                self.pairs[key] = self.pairs.get(key, 0) + 1
                self.examples.setdefault(
                    key, f"{frame.f_back.f_code.co_qualname} -> {frame.f_code.co_qualname}")
        if callee and callee.startswith("plugins."):
            self._opaque[tid] = 1

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def uninstall(self) -> None:
        self.on = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def report(self) -> list[dict[str, Any]]:
        return [{"from": a, "to": b, "calls": n, "first": self.examples[(a, b)]}
                for (a, b), n in self.pairs.items()]


def http_side(args: Any, max_tokens: int) -> list[dict[str, Any]]:
    from conformance.server_kit import ServerThread, http_request
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    tracer = Tracer()
    tracer.install()  # before the threads start (the server's, the client's reader, pools)
    engine = Engine(server_args=args)
    adapter = AsyncEngine(engine, "m")
    try:
        with ServerThread(create_app(adapter, args)) as srv:
            body = {"model": "m", "messages": QUESTION, "max_tokens": max_tokens,
                    "temperature": 0}
            http_request(srv.url, "POST", "/v1/chat/completions", body)  # warm (first imports)
            time.sleep(0.5)
            tracer.on = True
            status, _, raw = http_request(srv.url, "POST", "/v1/chat/completions", body)
            time.sleep(0.5)  # (the request's abort-on-exit and metrics settle)
            tracer.on = False
            assert status == 200, raw
    finally:
        tracer.uninstall()
        adapter.close()
    # the test client's own calls (conformance.server_kit.http_request) are not the server's
    return [p for p in tracer.report() if "conformance.server_kit" not in (p["from"], p["to"])]


def worker_side(args: Any, max_tokens: int) -> list[dict[str, Any]]:
    from core import messages as ipc
    from core.engine.sampling import SamplingParams
    from core.engine.worker import _apply, _item, build_engine_core, make_plan

    args, plan, spec, registry = make_plan(args)
    core = build_engine_core(args, plan, spec, registry)
    ids = tuple(range(10, 30))
    params = SamplingParams.from_dict({"max_new_tokens": max_tokens, "temperature": 0})
    line = ipc.encode(ipc.AddRequest("trace", ids, params, None))
    tracer = Tracer()
    sent: list[bytes] = []
    tracer.install()
    tracer.on = True
    try:
        _apply(core, ipc.decode(line), sent.append)
        done = False
        while not done:
            touched = core.scheduler.step()
            items = tuple(_item(r) for r in touched)
            sent.append(ipc.encode(ipc.StepOutput(items)))
            done = any(i.finish is not None for i in items)
    finally:
        tracer.uninstall()
    return tracer.report()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from core.plan.args import make_server_args

    args = make_server_args(model_path=a.model_path, max_total_tokens=2048)
    sides = {"http process": http_side(args, a.max_tokens),
             "worker": worker_side(args, a.max_tokens)}
    if a.json:
        print(json.dumps(sides, indent=1))
        return 0
    total = 0
    for side, pairs in sides.items():
        print(f"\n{side}: {len(pairs)} module pairs")
        for p in pairs:
            print(f"  {p['from']:<36} -> {p['to']:<36} {p['calls']:>5}  {p['first']}")
        total += len(pairs)
    print(f"\ntotal: {total} distinct module-crossing call pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
