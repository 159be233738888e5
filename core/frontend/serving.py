"""The engine as an asyncio server uses it (`AsyncEngine`, what core.server's `EngineLike`
asks for), over core.frontend.offline.Engine's public methods only: its worker process,
tokenizer and plan. Requests go straight to the engine's client (`Engine.client`: a
core.frontend.client.RequestStreams, one worker or a core.frontend.router.ReplicaSet). Requests come as `GenRequest`s and outputs go as `Delta`s; what the engine
refuses raises `core.frontend.refusal.Refused` with the status a server answers.

Pipe sends (submit, abort) run on one worker thread, in order, so a full pipe never blocks the
event loop; outputs come back through the client's reader thread into an asyncio queue.

Liveness (`health`) is the worker process being alive with a fresh heartbeat, which the worker
sends from its own thread every second: a long scheduler step (a big prefill on a CPU) does not
make a healthy engine read as dead. `stats` asks the scheduler (answered between steps) and falls
back to the figures of the last heartbeat when a step is running.

With --dp-size N the engine is N replicas behind core.frontend.router.ReplicaSet: liveness is every
replica's, `stats` are their sums plus `replicas`, one entry per replica (dp_rank, alive,
in_flight and routed: the router's counts, and that replica's own figures).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.frontend.delta import Delta
from core.frontend.refusal import Refused, invalid
from core.plan.args import ServerArgs

if TYPE_CHECKING:
    from core.contract.json_types import JSONObject
    from core.frontend.offline import Engine
    from core.frontend.prestart import StartedWorker

HEARTBEAT_STALE_S = 10.0  # no heartbeat for this long (sent every second): the worker is wedged
STATS_RPC_TIMEOUT_S = 1.0  # longer than this, a step is running: use the heartbeat's figures


@dataclass(frozen=True)
class GenRequest:
    """One sequence to generate: token ids in, sampling parameters in SGLang's names."""

    rid: str
    input_ids: tuple[int, ...]
    # max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p, frequency_penalty,
    # presence_penalty, repetition_penalty, stop, stop_token_ids, ignore_eos, seed,
    # skip_special_tokens -- only the keys the client gave, plus max_new_tokens (always set)
    sampling: JSONObject = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    lora: str | None = None  # the LoRA adapter serving it (None: the base model)


def served_name(args: ServerArgs, model_path: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path:
        return args.model_path  # SGLang's default: the path as given
    # the embedded default model: its name, not a site-packages path
    return os.path.basename(model_path).split(".")[0]


class AsyncEngine:
    """The server's engine: wraps core.frontend.offline.Engine (which owns the worker process)."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine  # its public methods only (core.frontend.offline.Engine)
        info = engine.info
        self.info = info
        self.tokenizer = engine.tokenizer  # (core.tokenizer.Tokenizer is a TokenizerLike)
        self.vocab_size = info.vocab_size  # the model's: the ids the engine accepts
        # the longest sequence that can run: the context, or the KV pool if that is smaller
        self.context_length = min(info.max_context, info.pool_tokens)
        self.model_name = model_name
        self.plan = engine.plan
        if self.plan is not None:  # the tool-call parser is chosen by the chat template
            from core.plan.reasoning import resolve_reasoning_parser
            from core.plan.registry import get_registry
            from core.plan.resolver import resolve_tool_parser

            self.plan = resolve_tool_parser(self.plan, engine.tokenizer.chat_template,
                                            engine.args, get_registry())
            self.plan = resolve_reasoning_parser(self.plan, engine.tokenizer.chat_template,
                                                 engine.args, get_registry())
        # one thread for pipe sends keeps submit-then-abort in order
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-send")
        self._rpc = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="core-rpc")
        self._closed = False

    # -- facts ----------------------------------------------------------------------------------

    def plan_dict(self) -> JSONObject | None:
        return self.plan.to_dict() if self.plan is not None else None

    def describe_plan(self) -> str:
        from core.plan.resolver import explain

        if self.plan is None:
            return ""
        text = explain(self.plan)
        args = self.engine.args
        if args.dp_size > 1:  # a row of the plan's table (its first block)
            lines = text.split("\n")
            end = lines.index("") if "" in lines else len(lines)
            lines.insert(end, f"  {'data parallel':<18} {args.dp_size} replicas, "
                              f"{args.load_balance_method}")
            text = "\n".join(lines)
        return text

    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters requests may name (name -> folder); None with LoRA off. The
        engine's record (with --dp-size > 1, the router's: those every replica holds)."""
        if self.plan is None or self.plan.lora_backend is None:
            return None
        return self.engine.lora_adapters()

    async def update_lora(self, op: str, name: str, path: str | None = None) -> JSONObject:
        """Load ("load", from folder `path`) or unload ("unload") LoRA adapter `name` in the
        engine, between its steps (with --dp-size > 1, in every replica); Refused 400 (404:
        not loaded) naming the reason, 503 when the engine is gone. The adapters requests may
        name follow (lora_adapters)."""
        from core.frontend.offline import EngineError

        call = (self.engine.load_lora_adapter if op == "load" else
                lambda n, _p: self.engine.unload_lora_adapter(n))
        try:
            return await asyncio.wrap_future(self._rpc.submit(call, name, path))
        except EngineError as e:
            raise Refused(503, f"the engine is not running: {e}", code="engine_unavailable",
                          retry_after=5) from None
        except ValueError as e:
            status = 404 if "is not loaded" in str(e) else 400
            raise Refused(status, str(e), param="lora_name",
                          code="model_not_found" if status == 404 else "invalid_value"
                          ) from None

    def model_info(self) -> JSONObject:
        args = self.engine.args
        spec = self.engine.spec
        return {"model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path or args.model_path,
                "architecture": getattr(spec, "architecture", None),
                "max_context": self.info.max_context, "kv_pool_tokens": self.info.pool_tokens,
                "kv_bytes_per_token": self.info.kv_bytes_per_token,
                "page_size": self.info.page_size,
                "max_running_requests": self.info.max_running_requests,
                "eos_token_ids": list(self.info.eos_token_ids),
                "device": self.info.device,
                # what the engine found at start-up, and its start-up phase by phase
                "engine_notes": list(self.info.notes),
                "startup_phases_s": {what: sec for what, sec in self.info.startup_phases},
                "client_startup_phases_s": {
                    what: sec for what, sec in getattr(self.engine, "startup_phases", ())},
                **({"dp_size": args.dp_size, "load_balance_method": args.load_balance_method}
                   if args.dp_size > 1 else {})}

    def validate_sampling(self, sampling: JSONObject) -> None:
        from core.messages import SamplingParams

        SamplingParams.from_dict(sampling).check_vocab(self.vocab_size)

    # -- requests -------------------------------------------------------------------------------

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.engine.client.abort(rid)
        except Exception:  # the engine is gone: nothing left to free
            pass

    def abort(self, rid: str) -> None:
        if self._closed:
            return
        try:
            self._sender.submit(self._abort_quietly, rid)
        except RuntimeError:  # shut down meanwhile: the engine is being stopped anyway
            pass

    async def generate(self, req: GenRequest) -> AsyncGenerator[Delta, None]:
        from core.frontend.offline import EngineError

        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Delta] = asyncio.Queue()

        def sink(delta: Delta) -> None:  # called on the client's reader thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, delta)
            except RuntimeError:  # the server's loop is closed: nobody is listening any more
                pass

        params = dict(req.sampling, logprobs=req.logprobs, top_logprobs=req.top_logprobs)
        if self._closed:
            raise Refused(503, "the engine is shutting down", code="engine_unavailable")
        fut = self._sender.submit(self.engine.client.submit, None, params,
                                  input_ids=list(req.input_ids), rid=req.rid, sink=sink,
                                  lora=req.lora)
        finished = False
        try:
            try:
                await asyncio.wrap_future(fut)
            except EngineError as e:
                finished = True
                raise Refused(503, f"the engine is not running: {e}", code="engine_unavailable",
                               retry_after=5) from None
            except ValueError as e:  # the engine's own checks (sampling, fits in context/pool,
                finished = True  # a constraint its grammar backend cannot enforce)
                raise invalid(_constraint_param(req, str(e)), str(e)) from None
            while True:
                d = await q.get()
                if d.error is not None:  # the worker (a rank, a replica) died, or was closed
                    finished = True  # one status, tokens sent or not (README "Probes")
                    raise Refused(503, f"the engine is not running: {d.error}",
                                   code="engine_unavailable", retry_after=5)
                fin = d.finish
                if fin is not None and fin.type == "abort" and fin.status_code:
                    # refused by the engine: at admission (queue full, too big, a constraint
                    # that did not compile), or a constraint that reached a dead end
                    finished = True
                    status = fin.status_code
                    message = fin.message or "rejected by the scheduler"
                    if status == 400:  # e.g. its constraint failed to compile in the worker
                        raise invalid(_constraint_param(req, message), message)
                    raise Refused(status, message,
                                   code="queue_full" if status == 503 else
                                   "model_not_found" if status == 404 else None,
                                   retry_after=1 if status in (429, 503) else None)
                if fin is not None:  # (the consumer may close this generator at its last
                    finished = True  # delta: nothing is left to abort then)
                yield d
                if fin is not None:
                    return
        finally:
            if not finished:
                # the consumer left: abort once the submit has gone out (it may still be queued)
                fut.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is not None
                    or self.abort(req.rid))

    # -- health and figures ---------------------------------------------------------------------

    def failure(self) -> str | None:
        """Why the engine is gone for good (its worker died), or None while it runs."""
        if self._closed:
            return None  # stopped on purpose
        return self.engine.failure()

    async def health(self) -> bool:
        # no round trip through the scheduler: a step may run for many seconds
        return (not self._closed and self.engine.health()
                and self.engine.heartbeat_age() < HEARTBEAT_STALE_S)

    async def stats(self) -> JSONObject:
        try:
            s = await asyncio.wrap_future(self._rpc.submit(self.engine.stats,
                                                           STATS_RPC_TIMEOUT_S))
        except RuntimeError:  # core.frontend.offline.EngineError: no answer in time, or gone
            # a step is running (or the engine is gone): the figures from between the last steps
            s = self.engine.heartbeat_stats()
            if not s:
                raise
            s = {**s, "stale": True}
        out = {**_figures(s), "engine": s}
        if "replicas" in s:  # data parallel (core.frontend.router.merge_stats)
            out["replicas"] = [
                {"dp_rank": r["dp_rank"], "alive": r["alive"], "in_flight": r["in_flight"],
                 "routed": r["routed"], **(_figures(r) if "running" in r else {}),
                 **({"stale": True} if r.get("stale") else {})} for r in s["replicas"]]
        return out

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:  # let queued aborts reach the worker, unless a send is stuck (a wedged worker)
            self._sender.submit(lambda: None).result(timeout=5)
        except Exception:
            pass
        self._sender.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
        self._rpc.shutdown(wait=False, cancel_futures=True)


def _constraint_param(req: GenRequest, message: str) -> str | None:
    """The request field a refusal names (its constraint's source), when the message is about
    that constraint."""
    source = (req.sampling.get("constraint") or {}).get("source")
    return source if source and message.startswith(source) else None


def _figures(s: JSONObject) -> JSONObject:
    """The server's names for a scheduler's figures (core.engine.scheduler.Scheduler.stats)."""
    total, free = s.get("total_pages", 0), s.get("free_pages", 0)
    # pages held by requests; reusable prefix-cache pages count as free (as SGLang counts)
    evictable = s.get("evictable_pages", s.get("cached_pages", 0))
    cached, computed = s.get("cached_tokens", 0), s.get("prefill_tokens", 0)
    # queued: waiting for a slot, or for their grammar to compile (the scheduler's compiling)
    return {"num_running_reqs": s.get("running", 0),
            "num_queued_reqs": s.get("waiting", 0) + s.get("compiling", 0),
            "kv_pages_used": total - free - evictable, "kv_pages_total": total,
            "kv_pages_cached": s.get("cached_pages", 0),
            "prefix_cache_hit_rate": cached / (cached + computed) if cached + computed
            else 0.0,
            # grammar compiles (core.engine.grammar_compiler): queued, running, outcomes
            **{k: v for k, v in s.items() if k.startswith("grammar_compile")},
            # speculative decoding (core.engine.scheduler.spec): drafts, tokens, accepted
            **{k: v for k, v in s.items() if k.startswith("spec_")},
            # a hybrid KV pool's windowed groups (core.engine.memory.kv_groups): their pages
            **{k: v for k, v in s.items() if k.startswith("kv_group")},
            # the prefill budget while decoding (core.engine.scheduler.budget)
            **{k: v for k, v in s.items() if k.startswith("prefill_budget")
               or k == "prefill_capped_steps"}}


def start_async_engine(args: ServerArgs, started: list[StartedWorker] | None = None
                       ) -> AsyncEngine:
    """Resolve the plan, load the model in the worker process (with --dp-size N, N workers
    started together behind core.frontend.router.ReplicaSet), wrap it for the server.
    `started`: the workers, spawned already (core.frontend.prestart)."""
    from core.frontend.offline import Engine

    engine = Engine(server_args=args, serving=True, started=started)
    return AsyncEngine(engine, served_name(args, engine.args.model_path))
