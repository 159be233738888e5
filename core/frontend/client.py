"""The engine's client side: owns the worker process and streams its outputs.

`EngineClient` starts the worker (multiprocessing "spawn"; scheduler + model runner live there),
gives it the resolved plan as data, and talks to it with typed messages sent as JSON over a pipe
(core.messages; nothing is pickled). Requests are validated here, once (`prepare`); the worker trusts
them. The client
tokenizes prompts and detokenizes outputs, so text work stays off the scheduler's critical path:
a background reader thread turns the worker's token ids into text (holding back text that
might be the start of a stop string) and hands each `core.frontend.delta.Delta` to the request's
sink, a queue for synchronous callers or an asyncio queue (through loop.call_soon_threadsafe) for
the HTTP server.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core import messages as ipc
from core.frontend.delta import Delta
from core.frontend.prestart import StartedWorker
from core.frontend.request_checks import RequestChecks
from core.messages import SPEC_FIELDS, Channel, ChannelClosed, SamplingParams
from core.plan.args import ServerArgs
from core.plan.plan import Plan

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from core.contract.capabilities import DeviceInfo
    from core.contract.grammar import Constraint
    from core.contract.json_types import JSON, JSONObject
    from core.engine.distributed import RankSpec
    from core.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("core.frontend.client")


class EngineError(RuntimeError):
    """The engine worker failed to start or died."""


@dataclass
class _ReqState:
    rid: str
    index: int
    params: SamplingParams
    sink: Callable[[Delta], None]
    detok: IncrementalDetokenizer
    raw_text: str = ""  # everything detokenized so far
    emitted: int = 0  # characters of raw_text already sent
    stop_floor: int = 0  # stop strings ending at or before this character do not count
    output_ids: list[int] = field(default_factory=list)


def device_index(args: ServerArgs, device: DeviceInfo, replica: int, local_rank: int = 0) -> int:
    """The device of one engine process on this node: replica r's ranks take devices
    r x (ranks per node) onwards, round-robin when there are fewer devices than ranks x
    replicas (a CPU, or --dp-size 2 on one GPU)."""
    return (replica * (args.tp_size // args.nnodes) + local_rank) % max(device.count, 1)


def rank_specs(args: ServerArgs, device: DeviceInfo, replica: int = 0) -> list[RankSpec]:
    """The RankSpecs of this node's ranks of one engine (core.engine.distributed) on `device` (a
    DeviceInfo: the plan's), this node's first rank first; empty when the engine is one
    process without torch.distributed (--tp-size 1, one node, no --dist-init-addr)."""
    if args.tp_size == 1 and args.nnodes == 1 and args.dist_init_addr is None:
        return []
    from core.contract.platform import load_platform
    from core.engine.distributed import RankSpec, free_loopback_port
    from core.plan.registry import get_registry

    platform = load_platform(get_registry(), device)
    addr = args.dist_init_addr or f"127.0.0.1:{free_loopback_port()}"
    here = args.tp_size // args.nnodes
    first = args.node_rank * here
    indices = [device_index(args, device, replica, i) for i in range(here)]
    return [RankSpec(rank=first + i, world=args.tp_size, init_addr=addr, local_index=index,
                     backend=platform.dist_backend(), device=platform.torch_device(index),
                     target=device.target, slot=replica * here + i)
            for i, index in enumerate(indices)]


def start_ranks(specs: list[RankSpec]) -> list[BaseProcess]:
    """Spawn one process per RankSpec (core.engine.worker.rank_main), daemonic: a parent that exits
    normally takes them along, and a parent that is killed leaves rank 0 orphaned, which then
    stops them."""
    from core.engine.worker import rank_main

    ctx = mp.get_context("spawn")
    procs = []
    for spec in specs:
        proc = ctx.Process(target=rank_main, args=(spec.to_json(),),
                           name=f"core-engine-rank{spec.rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def reap(proc: BaseProcess, wait: float, grace: float = 5.0) -> None:
    """Let `proc` end by itself for `wait` s, then SIGTERM it (`grace` s), then SIGKILL it."""
    proc.join(timeout=wait)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=grace)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


def serve_node(args: ServerArgs) -> int:
    """`core serve --node-rank N` (N > 0): run this node's tensor-parallel ranks of the
    engine node 0 serves (no HTTP here; the args and plan come from rank 0 once the group
    forms) until they end; SIGTERM / SIGINT stop them. Exit status 0 when every rank ended
    cleanly (node 0 shut the engine down), 1 otherwise."""
    import signal

    from core.plan.devices import select_device
    from core.plan.registry import get_registry

    device = select_device(get_registry(), args.device, None)
    procs = start_ranks(rank_specs(args, device))
    print(f"core serve: node {args.node_rank} of {args.nnodes}: {len(procs)} rank(s) joining "
          f"{args.dist_init_addr}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while any(p.is_alive() for p in procs) and not stop.wait(0.5):
        pass
    for p in procs:
        reap(p, wait=0.0, grace=10.0)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


class RequestStreams:
    """What EngineClient and core.frontend.router.ReplicaSet both offer callers on top of their own
    `prepare`, `submit_prepared`, `abort`, `health` and `rpc`: submit, the synchronous stream of
    a request submitted without a sink, the asyncio pair, and stats. `_take_queue(rid)` hands over that
    request's queue (None: unknown or streamed already); `_abortable(rid)` says whether an
    early-stopped stream can still abort its request."""

    def submit(self, prompt: str | None = None, params: SamplingParams | dict | None = None,
               *, input_ids: list[int] | None = None, rid: str | None = None,
               priority: int | None = None, sink: Callable[[Delta], None] | None = None,
               index: int = 0, lora: str | None = None) -> str:
        """Queue one request (n = 1); returns its id. Without a sink, read it with stream(id).
        lora: the name of a loaded LoRA adapter to serve it with (None: the base model)."""
        ids, p = self.prepare(prompt, input_ids, params)
        return self.submit_prepared(ids, p, rid=rid, priority=priority, sink=sink, index=index,
                                    lora=lora)

    def stream(self, rid: str, timeout: float | None = None) -> Iterator[Delta]:
        """Incremental outputs of a request submitted without a sink, until it finishes."""
        q = self._take_queue(rid)
        if q is None:
            raise KeyError(f"no streamable request {rid!r} (unknown, or streamed already)")
        while True:
            delta = q.get(timeout=timeout)
            if delta.error is not None:
                raise EngineError(delta.error)
            yield delta
            if delta.finished:
                return

    async def submit_async(self, prompt: str | None = None,
                           params: SamplingParams | dict | None = None, *,
                           input_ids: list[int] | None = None, rid: str | None = None,
                           priority: int | None = None, lora: str | None = None
                           ) -> tuple[str, asyncio.Queue[Delta]]:
        """Like submit, for an event loop: returns (id, asyncio.Queue of deltas)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()
        rid = self.submit(prompt, params, input_ids=input_ids, rid=rid, priority=priority,
                          sink=lambda d: loop.call_soon_threadsafe(q.put_nowait, d), lora=lora)
        return rid, q

    async def stream_async(self, prompt: str | None = None,
                           params: SamplingParams | dict | None = None, *,
                           input_ids: list[int] | None = None, rid: str | None = None,
                           priority: int | None = None, lora: str | None = None
                           ) -> AsyncIterator[Delta]:
        """Submit and yield deltas; aborts the request if the consumer stops early."""
        rid, q = await self.submit_async(prompt, params, input_ids=input_ids, rid=rid,
                                         priority=priority, lora=lora)
        finished = False
        try:
            while True:
                delta = await q.get()
                if delta.error is not None:
                    raise EngineError(delta.error)
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            if not finished and self._abortable(rid):
                self.abort(rid)

    def rpc(self, op: str, timeout: float = 60.0) -> JSON:
        """`op` answered by the worker(s) between steps (each subclass sends it its way)."""
        raise NotImplementedError

    def stats(self, timeout: float = 60.0) -> JSONObject:
        """The scheduler's figures (a ReplicaSet's: merged), answered between steps."""
        stats = self.rpc("stats", timeout)
        assert isinstance(stats, dict)
        return stats


class EngineClient(RequestStreams):
    """Starts the worker, submits requests, streams their outputs, shuts everything down."""

    def __init__(self, args: ServerArgs, plan: Plan, tokenizer: Tokenizer,
                 start_timeout: float = 900.0, started: StartedWorker | None = None,
                 replica: int = 0):
        """`args` with the model path filled in and `plan` resolved for them (core.engine.worker.
        make_plan): the worker builds exactly this plan. `started`: a worker spawned earlier
        (StartedWorker), sent the plan now, instead of a new one. `replica`: this engine's
        place among --dp-size replicas (its ranks use devices replica * tp-size onwards).
        With --tp-size N the worker is rank 0 and the client also spawns ranks 1..N-1 of
        this node (core.engine.worker.rank_main); they join rank 0 through torch.distributed."""
        from core.engine.worker import args_to_json, plan_to_json, worker_main

        self.args = args
        self.tokenizer = tokenizer
        self.plan = plan
        self._checks = RequestChecks(plan, tokenizer)  # validation at the edge
        self._reqs: dict[str, _ReqState] = {}
        self._sync_queues: dict[str, queue.Queue] = {}
        self._replies: dict[int, tuple[threading.Event, list[ipc.Reply]]] = {}
        self._rpc_ids = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self.dead_reason: str | None = None
        # the worker's heartbeat (core.engine.worker._Heartbeat): when it last came, and what it said
        self.last_heartbeat = time.monotonic()
        self.heartbeat: ipc.Heartbeat | None = None
        self.ranks: list[BaseProcess] = []  # processes of this node's ranks 1.. (tensor parallel)
        specs = rank_specs(args, plan.device, replica)
        rank0 = specs[0].to_json() if specs else None
        index = device_index(args, plan.device, replica)  # of this replica's first rank
        slot = replica * (args.tp_size // args.nnodes)  # its place among the node's processes
        if started is not None:
            self.process, parent_conn = started.process, started.conn
            try:
                parent_conn.send_bytes(json.dumps({"args": args_to_json(args),
                                                   "plan": plan_to_json(plan),
                                                   "rank": rank0,
                                                   "device_index": index,
                                                   "slot": slot}).encode())
            except OSError:
                pass  # the worker died while importing: _wait_ready says how
        else:
            ctx = mp.get_context("spawn")
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            self.process = ctx.Process(target=worker_main,
                                       args=(child_conn, args_to_json(args), plan_to_json(plan),
                                             rank0, index, slot),
                                       name="core-engine-worker", daemon=True)
            self.process.start()
            child_conn.close()
        self._chan = Channel(parent_conn)
        try:
            self.ranks = start_ranks(specs[1:])
            self.info = self._wait_ready(start_timeout)
        except BaseException:
            self._stop_process()
            raise
        self.last_heartbeat = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name="core-engine-reader",
                                        daemon=True)
        self._reader.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close()
        atexit.register(self._atexit)

    # -- start and stop --------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> ipc.EngineInfo:
        waited = 0.0
        while waited < timeout:
            try:
                if self._chan.poll(0.5):
                    msg = self._chan.recv()
                    if isinstance(msg, ipc.Ready):
                        return msg.info
                    if isinstance(msg, ipc.Fatal):
                        raise EngineError(f"engine failed to start: {msg.error}")
                    continue
            except ChannelClosed:
                pass
            if not self.process.is_alive():
                raise EngineError(
                    f"engine worker exited during start-up (exit code {self.process.exitcode}); "
                    f"a script that starts an engine must do so under "
                    f"`if __name__ == '__main__':` (the worker is spawned, re-importing it)")
            dead = self.rank_failure()
            if dead is not None:
                raise EngineError(f"engine failed to start: {dead}")
            waited += 0.5
        raise EngineError(f"engine did not start within {timeout:.0f} s")

    def _stop_process(self) -> None:
        try:
            with self._send_lock:
                self._chan.send(ipc.Shutdown())
        except ChannelClosed:
            pass
        for proc in (self.process, *self.ranks):  # the ranks end with rank 0's shutdown
            reap(proc, wait=15.0)

    def rank_failure(self) -> str | None:
        """Why a tensor-parallel rank other than 0 is gone (None while they all run)."""
        for i, proc in enumerate(self.ranks, start=1):
            if not proc.is_alive():
                return (f"tensor-parallel rank {i} exited (exit code {proc.exitcode}); the "
                        f"engine cannot run without it")
        return None

    def close(self) -> None:
        """Stop the worker (gracefully, then by force) and the reader thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_process()
        self._reader.join(timeout=10)
        self._chan.close()
        self._fail_all("engine closed")
        atexit.unregister(self._atexit)

    def health(self) -> bool:
        """True while the worker process (and every rank) is alive and its pipe is open."""
        return (not self._closed and self.dead_reason is None and self.process.is_alive()
                and self.rank_failure() is None)

    def heartbeat_age(self) -> float:
        """Seconds since the worker's last heartbeat (sent every second from a thread of the
        worker, whether or not a scheduler step is running)."""
        return time.monotonic() - self.last_heartbeat

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting ------------------------------------------------------------------------------

    def _send(self, msg: ipc.Message) -> None:
        if self._closed or self.dead_reason is not None:
            raise EngineError(f"engine is not running: {self.dead_reason or 'closed'}")
        try:
            with self._send_lock:
                self._chan.send(msg)
        except ChannelClosed as exc:
            raise EngineError(f"engine is not running: {exc}") from exc

    def prepare(self, prompt: str | None, input_ids: list[int] | None,
                params: SamplingParams | dict | None) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate (raises ValueError naming the problem)."""
        return self._checks.prepare(prompt, input_ids, params, self.info)

    def check_constraint(self, constraint: Constraint) -> None:
        """ValueError naming the problem when the engine cannot enforce this constraint."""
        self._checks.check_constraint(constraint, self.info)

    def submit_prepared(self, ids: list[int], p: SamplingParams, *, rid: str | None = None,
                        priority: int | None = None, sink: Callable[[Delta], None] | None = None,
                        index: int = 0, lora: str | None = None) -> str:
        """`submit` for what `prepare` returned (validated already: not checked again)."""
        rid = rid or uuid.uuid4().hex
        if sink is None:
            q: queue.Queue = queue.Queue()
            self._sync_queues[rid] = q
            sink = q.put
        detok = self.tokenizer.detokenizer(ids, p.skip_special_tokens)
        with self._lock:
            if rid in self._reqs:
                raise ValueError(f"request id {rid!r} is already in use")
            self._reqs[rid] = _ReqState(rid, index, p, sink, detok)
        try:
            self._send(ipc.AddRequest(rid, tuple(ids), p, priority, lora))
        except EngineError:
            with self._lock:
                self._reqs.pop(rid, None)
            self._sync_queues.pop(rid, None)
            raise
        return rid

    def _take_queue(self, rid: str) -> queue.Queue | None:
        return self._sync_queues.pop(rid, None)

    def _abortable(self, rid: str) -> bool:
        return self.health()

    def abort(self, rid: str) -> None:
        """Stop a request; its stream ends with finish_reason {"type": "abort"}."""
        with self._lock:
            known = rid in self._reqs
        if known:
            self._send(ipc.Abort(rid))

    # -- control ---------------------------------------------------------------------------------

    def rpc(self, op: str, timeout: float = 60.0) -> JSON:
        msg = self._call(op, timeout)
        if not msg.ok:
            raise EngineError(msg.error or "engine failed")
        return msg.result

    def _call(self, op: str, timeout: float, args: dict[str, str] | None = None) -> ipc.Reply:
        rid = next(self._rpc_ids)
        done, box = threading.Event(), []
        self._replies[rid] = (done, box)
        self._send(ipc.Rpc(rid, op, args))
        if not done.wait(timeout):
            self._replies.pop(rid, None)
            raise EngineError(f"engine did not answer {op!r} within {timeout:.0f} s")
        return box[0]

    def update_lora(self, op: str, name: str, path: str | None = None,
                    timeout: float = 120.0) -> JSON:
        """Load (op "load_lora", from folder `path`) or unload ("unload_lora") the LoRA
        adapter `name` between the worker's steps. ValueError with the worker's reason when it
        refuses (nothing changed); EngineError when the engine is gone."""
        msg = self._call(op, timeout, {"name": name, **({"path": path} if path else {})})
        if not msg.ok:
            raise ValueError((msg.error or "refused").removeprefix("AdapterError: ")
                             .removeprefix("ValueError: "))
        return msg.result

    def check_accounting(self) -> None:
        """Ask the worker to assert its KV page accounting (raises EngineError if broken)."""
        self.rpc("check_accounting")

    def flush_cache(self) -> None:
        self.rpc("flush_cache")

    # -- the reader thread -----------------------------------------------------------------------

    def _read_loop(self) -> None:
        reason = "engine worker exited"
        try:
            while True:
                msg = self._chan.recv()
                if isinstance(msg, ipc.StepOutput):
                    for item in msg.items:
                        self._on_item(item)
                elif isinstance(msg, ipc.Reply):
                    waiter = self._replies.pop(msg.id, None)
                    if waiter is not None:
                        waiter[1].append(msg)
                        waiter[0].set()
                elif isinstance(msg, ipc.Heartbeat):
                    self.heartbeat = msg
                    self.last_heartbeat = time.monotonic()
                elif isinstance(msg, ipc.Fatal):
                    reason = f"engine worker failed: {msg.error}"
        except ChannelClosed:
            pass
        except Exception as exc:  # noqa: BLE001 - a detokenizer bug must not hang callers
            reason = f"engine client reader failed: {type(exc).__name__}: {exc}"
        if not self._closed:
            self.dead_reason = reason
        self._fail_all(self.dead_reason or "engine closed")
        for rpc_id, (done, box) in list(self._replies.items()):
            box.append(ipc.Reply(rpc_id, False, error=reason))
            done.set()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            states = list(self._reqs.values())
            self._reqs.clear()
        for st in states:
            st.sink(Delta.failed(st.rid, st.index, reason))

    def _on_item(self, item: ipc.OutputItem) -> None:
        with self._lock:
            st = self._reqs.get(item.rid)
        if st is None:  # finished here already (a stop string seen in the text)
            return
        ids = item.ids
        finish = item.finish
        st.output_ids += ids
        if ids:
            st.raw_text += st.detok.add(list(ids))
        if finish is not None:
            st.raw_text += st.detok.flush()
        end = len(st.raw_text)
        stops = st.params.stop
        if stops:
            # The worker decides where a stop string ends the output (core.engine.scheduler:
            # it stops computing at once, and jump-forward / speculation stop at the right
            # token); here the text is cut where the string it matched starts, and held back
            # while streaming where a stop string could be starting.
            longest = max(len(s) for s in stops)
            if len(st.output_ids) < st.params.min_new_tokens:
                # min_new_tokens: what completes a stop string before then is plain text
                st.stop_floor = len(st.raw_text)
            matched = finish.matched if finish is not None else None
            if isinstance(matched, str):
                at = st.raw_text.find(matched, max(0, st.emitted - longest,
                                                   st.stop_floor - len(matched) + 1))
                end = at if at >= 0 else end
            elif finish is None:
                end = max(st.emitted, len(st.raw_text) - (longest - 1))
        text = st.raw_text[st.emitted:end]
        st.emitted = end
        spec = {k: v for k in SPEC_FIELDS if (v := getattr(item, k)) is not None} or None
        delta = Delta(st.rid, st.index, text, ids, finish, item.prompt_tokens,
                      len(st.output_ids), item.cached_tokens,
                      item.logprobs if st.params.logprobs else None, item.prompt_logprobs,
                      spec=spec)
        if finish is not None:
            with self._lock:
                self._reqs.pop(st.rid, None)
        try:
            st.sink(delta)
        except Exception:  # noqa: BLE001 - e.g. a closed event loop: that caller is gone
            log.warning("dropping output of request %s: its consumer is gone", st.rid)
