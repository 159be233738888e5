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
order first seen, with how many calls took it.

The main line (issue 31's "calls between modules from the HTTP handler to the sampler and
back"), measured at stations: at each station, the stack that reached it from the root of its
thread or task, and on that stack every call whose caller and callee are in different modules
(an edge; one shared by several stations' stacks counts once; the test harness's own frames
are not the server's). Two counts:

- the spine: the stations where the request leaves a thread, task or process (the handler's
  task hands it to the engine, the pipe send, the worker's receive, admission, the worker's
  send, the client's receive, the delivery to the handler's task), the sampler, and the
  response's JSON: the chain of calls that carries the request down to the sampler and its
  output back. A hand-off (a queue, the pipe) is not a call and is not counted. This is the
  Done-when's count.
- all stations: the spine plus the side calls that transform the request and return (parse,
  chat template, tokenize, the client's checks, the model's forward, the output item, the
  delta, the response object).

Every station must be reached: one that is not (renamed, moved) fails the run rather than
shortening the count.
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


# (module, function qualname) of each station, per side: "x.*" any module under x, "*.f" any
# qualname ending in ".f" (the model's forward is any `forward` of a module under plugins.models)
HTTP_STATIONS = {
    "handoff": ("core.frontend.serving", "AsyncEngine.generate"),
    "parse": ("core.server.protocol", "parse_chat"),
    "template": ("core.tokenizer", "Tokenizer.apply_chat_template"),
    "tokenize": ("core.tokenizer", "Tokenizer.encode"),
    "check": ("core.frontend.request_checks", "RequestChecks.prepare"),
    "encode": ("core.messages", "encode"),
    "decode": ("core.messages", "decode"),
    "delta": ("core.frontend.delta", "*.__init__"),  # (a dataclass's __init__ has no class
    # in its qualname; Delta is the module's one dataclass)
    "deliver": ("core.frontend.serving", "AsyncEngine.generate.<locals>.sink"),
    "response": ("core.server.responses", "chat_object"),
    "json": ("core.server.responses", "dumps"),
}
WORKER_STATIONS = {
    "decode": ("core.messages", "decode"),
    "admit": ("core.engine.scheduler.scheduler", "Scheduler.admit"),
    "forward": ("plugins.models.*", "*.forward"),
    "sample": ("core.engine.sampling", "Sampler.launch"),
    "output": ("core.engine.worker", "_item"),
    "encode": ("core.messages", "encode"),
}


SPINE = {"http process": ("handoff", "encode", "decode", "deliver", "json"),
         "worker": ("decode", "admit", "sample", "encode")}


def _station(stations: dict[str, tuple[str, str]], module: str, qualname: str) -> str | None:
    for name, (mod, qual) in stations.items():
        mod_ok = module == mod or (mod.endswith(".*") and module.startswith(mod[:-1]))
        qual_ok = qualname == qual or (qual.startswith("*.") and qualname.endswith(qual[1:]))
        if mod_ok and qual_ok:
            return name
    return None


def stack_edges(frame: FrameType) -> list[tuple[str, str]]:
    """The module-crossing calls on the stack that reached `frame`, outermost first, each as
    ("caller module:function", "callee module:function"); frames outside the project (asyncio,
    aiohttp, threading) are skipped over."""
    chain: list[tuple[str, str]] = []
    f: FrameType | None = frame
    while f is not None:
        mod = module_of(f)
        if mod is not None:
            chain.append((mod, f.f_code.co_qualname))
        f = f.f_back
    chain.reverse()
    return [(f"{a[0]}:{a[1]}", f"{b[0]}:{b[1]}")
            for a, b in zip(chain, chain[1:], strict=False) if a[0] != b[0]]


class Tracer:
    """Counts module-crossing calls between project modules while `on`. A call into a plugin
    (plugins.*: the model, a kernel, the platform) counts; what runs inside it is not
    followed. Installed on every thread started after `install()` and on this one."""

    def __init__(self, stations: dict[str, tuple[str, str]],
                 thread: int | None = None) -> None:
        self.stations = stations
        self.thread = thread  # stations are taken on this thread only (None: any)
        self.reached: dict[str, list[tuple[str, str]]] = {}  # station -> its stack's edges
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
        if callee is not None:
            station = _station(self.stations, callee, frame.f_code.co_qualname)
            if station is not None and station not in self.reached and (
                    self.thread is None or self.thread == tid):
                self.reached[station] = stack_edges(frame)
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

    def main_line(self) -> list[list[str]]:
        """The main line's edges (each once, in station order), with the stations whose stack
        holds each; SystemExit when a station was not reached."""
        missed = [s for s in self.stations if s not in self.reached]
        if missed:
            raise SystemExit(f"stations not reached: {missed} (renamed or moved? update "
                             f"STATIONS in {__file__})")
        edges: dict[tuple[str, str], list[str]] = {}
        for station in self.stations:
            for edge in self.reached[station]:
                if not any(e.startswith("conformance.") for e in edge):  # the test harness
                    edges.setdefault(edge, []).append(station)
        return [[a, b, ",".join(st)] for (a, b), st in edges.items()]


def http_side(args: Any, max_tokens: int) -> tuple[list[dict[str, Any]], list[list[str]]]:
    from conformance.server_kit import ServerThread, http_request
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    tracer = Tracer(HTTP_STATIONS)
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
    pairs = [p for p in tracer.report() if "conformance.server_kit" not in (p["from"], p["to"])]
    return pairs, tracer.main_line()


def worker_side(args: Any, max_tokens: int
                ) -> tuple[list[dict[str, Any]], list[list[str]]]:
    import multiprocessing

    from core import messages as ipc
    from core.engine.worker import build_engine_core, make_plan, serve

    args, plan, spec, registry = make_plan(args)
    core = build_engine_core(args, plan, spec, registry)
    ids = tuple(range(10, 30))
    params = ipc.SamplingParams.from_dict({"max_new_tokens": max_tokens, "temperature": 0})
    ours, theirs = multiprocessing.Pipe()
    client = ipc.Channel(ours)

    def answer() -> None:  # the client's end: the request in, outputs read until it finishes
        client.send(ipc.AddRequest("trace", ids, params, None))
        while True:
            msg = client.recv()
            if isinstance(msg, ipc.StepOutput) and any(i.finish is not None for i in msg.items):
                client.send(ipc.Shutdown())
                return

    tracer = Tracer(WORKER_STATIONS, threading.get_ident())
    tracer.install()
    tracer.on = True
    other = threading.Thread(target=answer, name="trace-client")
    try:  # the worker's own loop; no heartbeat during the trace (it would be a side line)
        other.start()
        serve(core, ipc.Channel(theirs), heartbeat_s=3600.0)
        other.join(timeout=30)
    finally:
        tracer.uninstall()
    # the stand-in client's calls are not the worker's
    pairs = [p for p in tracer.report() if not p["first"].startswith("worker_side.")]
    return pairs, tracer.main_line()


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
        print(json.dumps({k: {"pairs": v[0], "main_line": v[1]} for k, v in sides.items()},
                         indent=1))
        return 0
    total = line = spine = 0
    for side, (pairs, main) in sides.items():
        print(f"\n{side}: {len(pairs)} module pairs")
        for p in pairs:
            print(f"  {p['from']:<36} -> {p['to']:<36} {p['calls']:>5}  {p['first']}")
        total += len(pairs)
        on_spine = [e for e in main if set(e[2].split(",")) & set(SPINE[side])]
        print(f"\n{side}: {len(main)} calls between modules at all stations, "
              f"{len(on_spine)} on the spine (*)")
        for a_, b_, stations in main:
            star = "*" if (a_, b_, stations) in [tuple(e) for e in on_spine] else " "
            print(f"{star} {a_:<58} -> {b_:<58} [{stations}]")
        line += len(main)
        spine += len(on_spine)
    print(f"\ntotal: {total} distinct module-crossing call pairs; {line} calls between modules "
          f"at all stations; {spine} on the spine (handler -> sampler -> JSON)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
