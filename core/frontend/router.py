"""The router: data parallelism (`--dp-size N`), N engine replicas behind one client.

`ReplicaSet` owns N `core.frontend.client.EngineClient`s made from the same args and plan, each with its
own worker process (started together, so start-up takes about as long as for one; replica i is
given `replica=i`, which offsets its device index). It speaks the EngineClient interface that
`core.frontend.offline.Engine` and the server use (prepare, submit, submit_prepared, stream,
abort, the asyncio pair, rpc, stats, health, update_lora), so everything above it is written
once. Every request goes to one replica; the router remembers which, so that abort and stream
reach it, and counts each replica's load: its requests from submit to the delta that ends them
(finished, aborted, or an error).

Routing (`--load-balance-method`). Loads are the router's counts; a dead replica is never
picked; ties go to the lowest index.

- round_robin: the next live replica after the one picked last.
- shortest_queue: the least-loaded live replica.
- prefix_aware (after SGLang's cache-aware router): each replica has a host-side record of the
  prompts routed to it, as chained hashes of whole blocks of `chunk` tokens (max(16, the page
  size)); a block's hash covers the whole prefix up to its end. A record holds at most
  `capacity` blocks, least recently used out first, a prefix's head outliving its tail. A
  request's match on a replica is the tokens in its leading blocks found there; the best
  replica is the longest match (ties: lower load). Below one block of match it goes to the
  least-loaded replica (no prefix worth keeping together); and when the best replica's load
  exceeds the least-loaded one's by more than `balance_threshold` (8) requests it goes to the
  least-loaded one too, so that one hot prefix cannot pile every request onto one replica.
  The record is approximate: it does not see the engine's own evictions, and is cleared by
  flush_cache.

LoRA adapters (`--enable-lora`). Every replica holds the same ones: those named at start, and
those loaded at run time through `update_lora`, which loads or unloads on every replica and
steps back when one refuses (core.frontend.replica_loras says how). A request naming an
adapter is routed only while every replica holds it; one naming an adapter that is unknown,
half loaded or being unloaded is refused here as a worker refuses it (404, "not loaded").

Failure. Any replica's death is the engine's failure: `failure()` names the replica and why,
`health()` turns False, and the server exits with its "engine died" status as it does for one
engine, so that its supervisor restarts the whole server. A server that went on at 1/N of its
capacity would look healthy to that supervisor and to the load balancer in front of it while
the lost replica never came back (restarting one in place would be a second supervisor,
inside the server); the requests the dead replica held fail either way. Until the server
exits, and for the offline Engine, the router sends new requests only to live replicas; the
dead one's requests end with an error delta (its client's reader says why), so nothing hangs.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from core import messages as ipc
from core.frontend.client import EngineClient, EngineError, RequestStreams
from core.frontend.delta import Delta
from core.frontend.prestart import StartedWorker
from core.frontend.replica_loras import ReplicaLoras, not_loaded
from core.messages import Finish, SamplingParams
from core.plan.args import ServerArgs
from core.plan.plan import Plan

if TYPE_CHECKING:
    from core.contract.grammar import Constraint
    from core.contract.json_types import JSON, JSONObject
    from core.tokenizer import Tokenizer

MIN_CHUNK_TOKENS = 16  # prefix_aware's block: at least this, at least one KV page
RECORD_CAPACITY = 1 << 16  # blocks remembered per replica (1M tokens at 16 per block)
BALANCE_THRESHOLD = 8  # prefix_aware: more extra requests than this on the best match: balance
# scheduler figures that do not add up over replicas: in the total only where all agree
_NOT_SUMMED = frozenset({"page_size", "new_token_ratio", "prefill_budget_target_ms",
                         "prefill_budget_tokens", "prefill_budget_extend_tok_s",
                         "prefill_budget_decode_ms"})
_PER_REPLICA = frozenset({"dp_rank", "alive", "stale"})


# -- policies -------------------------------------------------------------------------------------

class Policy(Protocol):
    """Picks a replica per request. Called under the router's lock, never concurrently."""

    name: str

    def pick(self, ids: Sequence[int], loads: Sequence[int | None]) -> int:
        """The replica for a request whose prompt is `ids`. loads[i]: replica i's unfinished
        requests, None for one that cannot take any (at least one can)."""
        ...

    def forget(self) -> None:
        """Drop what was learnt about the replicas' caches (they were flushed)."""
        ...


def _least_loaded(loads: Sequence[int | None]) -> int:
    return min((load, i) for i, load in enumerate(loads) if load is not None)[1]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def pick(self, ids: Sequence[int], loads: Sequence[int | None]) -> int:
        n = len(loads)
        for k in range(n):
            i = (self.next + k) % n
            if loads[i] is not None:
                self.next = i + 1
                return i
        raise ValueError("no live replica")

    def forget(self) -> None:
        pass


class ShortestQueue:
    name = "shortest_queue"

    def pick(self, ids: Sequence[int], loads: Sequence[int | None]) -> int:
        return _least_loaded(loads)

    def forget(self) -> None:
        pass


class PrefixRecord:
    """One replica's approximate record of the prompt prefixes routed to it: block hashes
    (PrefixAware.blocks) in least-recently-used order, at most `capacity` of them."""

    def __init__(self, capacity: int = RECORD_CAPACITY):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are here."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        # last block first: the head of a prefix is the most recent, so it is evicted last
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class PrefixAware:
    """The longest recorded prefix wins, unless it is short or its replica is overloaded (the
    module docstring has the rule)."""

    name = "prefix_aware"

    def __init__(self, n: int, chunk: int = MIN_CHUNK_TOKENS, capacity: int = RECORD_CAPACITY,
                 balance_threshold: int = BALANCE_THRESHOLD):
        self.chunk, self.balance_threshold = chunk, balance_threshold
        self.records = [PrefixRecord(capacity) for _ in range(n)]

    def blocks(self, ids: Sequence[int]) -> list[int]:
        """Chained hashes of the whole `chunk`-token blocks of `ids`."""
        out, h = [], 0
        for k in range(0, len(ids) - self.chunk + 1, self.chunk):
            h = hash((h, *ids[k:k + self.chunk]))
            out.append(h)
        return out

    def matches(self, ids: Sequence[int]) -> list[int]:
        """Per replica, the tokens of `ids`' prefix its record holds."""
        hashes = self.blocks(ids)
        return [r.match(hashes) * self.chunk for r in self.records]

    def pick(self, ids: Sequence[int], loads: Sequence[int | None]) -> int:
        hashes = self.blocks(ids)
        least = _least_loaded(loads)
        live = [i for i, load in enumerate(loads) if load is not None]
        match = {i: self.records[i].match(hashes) for i in live}
        best = min(live, key=lambda i: (-match[i], loads[i], i))
        if match[best] == 0 or loads[best] - loads[least] > self.balance_threshold:
            best = least
        self.records[best].add(hashes)
        return best

    def forget(self) -> None:
        for r in self.records:
            r.blocks.clear()


def make_policy(name: str, n: int, page_size: int = 1) -> Policy:
    """The policy for `--load-balance-method name` over n replicas."""
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "prefix_aware":
        return PrefixAware(n, chunk=max(MIN_CHUNK_TOKENS, page_size))
    raise ValueError(f"--load-balance-method: {name!r} is not one of round_robin, "
                     f"shortest_queue, prefix_aware")


# -- the replica set ------------------------------------------------------------------------------

def client_failure(client: EngineClient) -> str | None:
    """Why one client's worker is gone (it died or exited), or None while it runs."""
    if client.dead_reason is not None:
        return client.dead_reason
    if not client.process.is_alive():
        return f"engine worker exited (exit code {client.process.exitcode})"
    ranks = getattr(client, "rank_failure", None)  # its tensor-parallel ranks 1..
    return ranks() if ranks is not None else None


def merge_stats(replicas: list[JSONObject]) -> JSONObject:
    """The engine's figures from each replica's: numbers (and dicts of numbers) summed, the
    ones that do not add up kept where every replica agrees; `replicas` holds each one's."""
    total: JSONObject = {}
    same: dict[str, set[JSON]] = {}
    for r in replicas:
        for k, v in r.items():
            if k in _PER_REPLICA:
                continue
            if k in _NOT_SUMMED:
                same.setdefault(k, set()).add(v)
            else:
                total[k] = _add(total.get(k), v)
    counted = sum(1 for r in replicas if "running" in r)  # replicas with scheduler figures
    total.update({k: next(iter(vs)) for k, vs in same.items() if len(vs) == 1})
    if any(r.get("stale") for r in replicas):
        total["stale"] = True
    total["replicas"] = replicas
    total["alive_replicas"] = sum(1 for r in replicas if r.get("alive"))
    total["reporting_replicas"] = counted
    return total


def _add(a: JSON, b: JSON) -> JSON:
    if isinstance(b, bool):
        return a if a is not None else b
    if isinstance(b, (int, float)):
        return (a or 0) + b if isinstance(a, (int, float, type(None))) else a
    if isinstance(b, dict):
        base = dict(a) if isinstance(a, dict) else {}
        for k, v in b.items():
            base[k] = _add(base.get(k), v)
        return base
    return a if a is not None else b


class ReplicaSet(RequestStreams):
    """N engine replicas (worker processes) behind EngineClient's interface; see the module
    docstring for how a request finds its replica and what a dead one means."""

    def __init__(self, args: ServerArgs, plan: Plan, tokenizer: Tokenizer, *,
                 started: Sequence[StartedWorker] | None = None, start_timeout: float = 900.0,
                 policy: Policy | None = None):
        """`args.dp_size` replicas of (`args`, `plan`); `started`: one prestarted worker per
        replica (core.frontend.prestart.StartedWorker), all handed over (cancelled if start-up fails)."""
        n = args.dp_size
        if started is not None and len(started) != n:
            raise ValueError(f"{len(started)} started workers for {n} replicas")
        self.args, self.plan, self.tokenizer = args, plan, tokenizer
        self.policy = policy or make_policy(args.load_balance_method, n, plan.page_size)
        self.replicas = _start_all(args, plan, tokenizer, started, start_timeout)
        self.info: ipc.EngineInfo = self.replicas[0].info  # the same engine N times, but pid
        self._owner: dict[str, int] = {}  # rid -> the replica that holds it
        self._loads = [0] * n  # unfinished requests per replica
        self.routed = [0] * n  # requests sent to each replica, ever
        self._sync_queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="core-replicas")
        self._closed = False
        self.loras: ReplicaLoras | None = None  # with LoRA on: the replicas' adapters
        if plan.lora_backend is not None:
            from core.plan.lora import adapter_specs

            self.loras = ReplicaLoras(self.replicas, self._pool,
                                      {s.name: s.path for s in adapter_specs(args)})
        self._lora_of: dict[str, str] = {}  # rid -> its adapter, while it runs

    # -- liveness ----------------------------------------------------------------------------

    @property
    def infos(self) -> list[ipc.EngineInfo]:
        return [c.info for c in self.replicas]

    def loads(self) -> list[int]:
        """Each replica's unfinished requests (the router's count)."""
        with self._lock:
            return list(self._loads)

    def owner(self, rid: str) -> int | None:
        """The replica that holds request `rid` (None: unknown or finished)."""
        with self._lock:
            return self._owner.get(rid)

    def failure(self) -> str | None:
        """Why the engine is gone: the first dead replica and its reason; None while all run."""
        for i, c in enumerate(self.replicas):
            reason = client_failure(c)
            if reason is not None:
                return f"data-parallel replica {i} of {len(self.replicas)}: {reason}"
        return None

    @property
    def dead_reason(self) -> str | None:
        return None if self._closed else self.failure()

    def health(self) -> bool:
        """True while every replica's worker is alive."""
        return not self._closed and all(c.health() for c in self.replicas)

    def heartbeat_age(self) -> float:
        """The stalest replica's seconds since its last heartbeat."""
        return max(c.heartbeat_age() for c in self.replicas)

    @property
    def heartbeat(self) -> ipc.Heartbeat | None:
        """The replicas' last heartbeats as one: their figures merged, the longest step."""
        beats = [c.heartbeat for c in self.replicas]
        if all(b is None or b.stats is None for b in beats):
            return None
        per = [{**(b.stats if b is not None and b.stats is not None else {}), **self._meta(i)}
               for i, b in enumerate(beats)]
        return ipc.Heartbeat(merge_stats(per), max(b.step_s for b in beats if b is not None))

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every replica (together: each may wait seconds for its worker); idempotent."""
        if self._closed:
            return
        self._closed = True
        list(self._pool.map(lambda c: c.close(), self.replicas))
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- requests ----------------------------------------------------------------------------

    def prepare(self, prompt: str | None, input_ids: list[int] | None,
                params: SamplingParams | dict | None) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate (ValueError naming the problem); the same for every replica."""
        return self.replicas[0].prepare(prompt, input_ids, params)

    def check_constraint(self, constraint: Constraint) -> None:
        self.replicas[0].check_constraint(constraint)

    def submit_prepared(self, ids: list[int], p: SamplingParams, *, rid: str | None = None,
                        priority: int | None = None, sink: Callable[[Delta], None] | None = None,
                        index: int = 0, lora: str | None = None) -> str:
        """`submit` for what `prepare` returned (every replica holds the same adapters; a
        request naming one that requests may not name now ends at once, refused 404)."""
        rid = rid or uuid.uuid4().hex
        q: queue.Queue | None = None
        if sink is None:
            q = queue.Queue()
            sink = q.put
        with self._lock:
            if self._closed:
                raise EngineError("engine is not running: closed")
            if rid in self._owner:
                raise ValueError(f"request id {rid!r} is already in use")
            loads = [load if c.health() else None
                     for load, c in zip(self._loads, self.replicas, strict=True)]
            if all(load is None for load in loads):
                raise EngineError(f"engine is not running: {self.failure() or 'closed'}")
            if q is not None:
                self._sync_queues[rid] = q
            refused = (lora is not None and self.loras is not None
                       and not self.loras.acquire(lora))
            if not refused:
                i = self.policy.pick(ids, loads)
                self._owner[rid] = i
                self._loads[i] += 1
                self.routed[i] += 1
                if lora is not None and self.loras is not None:
                    self._lora_of[rid] = lora
        if refused:  # as the worker's admission refuses it, never reaching one
            sink(Delta(rid, index, "", (), Finish("abort", message=not_loaded(lora),
                                                  status_code=404), prompt_tokens=len(ids)))
            return rid
        user_sink = sink

        def routed_sink(delta: Delta) -> None:  # on replica i's reader thread
            if delta.finished:  # (a failed request's delta is finished too)
                self._release(rid)
            user_sink(delta)

        try:
            self.replicas[i].submit_prepared(ids, p, rid=rid, priority=priority,
                                             sink=routed_sink, index=index, lora=lora)
        except BaseException:
            self._release(rid)
            with self._lock:
                self._sync_queues.pop(rid, None)
            raise
        return rid

    def _release(self, rid: str) -> None:
        with self._lock:
            i = self._owner.pop(rid, None)
            if i is not None:
                self._loads[i] -= 1
            lora = self._lora_of.pop(rid, None)
            if lora is not None and self.loras is not None:
                self.loras.release(lora)

    def _take_queue(self, rid: str) -> queue.Queue | None:
        with self._lock:
            return self._sync_queues.pop(rid, None)

    def _abortable(self, rid: str) -> bool:
        i = self.owner(rid)
        return i is not None and self.replicas[i].health()

    def abort(self, rid: str) -> None:
        """Stop a request on the replica that holds it (no-op when unknown or finished)."""
        i = self.owner(rid)
        if i is not None:
            self.replicas[i].abort(rid)

    # -- control -----------------------------------------------------------------------------

    def _meta(self, i: int) -> JSONObject:
        with self._lock:
            load, routed = self._loads[i], self.routed[i]
        return {"dp_rank": i, "alive": self.replicas[i].health(), "in_flight": load,
                "routed": routed}

    def _replica_stats(self, i: int, timeout: float) -> JSONObject:
        c = self.replicas[i]
        meta = self._meta(i)
        if not meta["alive"]:
            return meta
        try:
            return {**c.rpc("stats", timeout), **meta}
        except EngineError:  # a step is running: the figures of its last heartbeat
            beat = c.heartbeat
            if beat is None or beat.stats is None:
                return meta
            return {**beat.stats, **meta, "stale": True}

    def rpc(self, op: str, timeout: float = 60.0) -> JSON:
        """`op` on every replica at once. "stats": merge_stats of theirs (a busy replica's from
        its last heartbeat; EngineError when none answers); other ops: their results, in
        replica order (EngineError naming the first replica that failed)."""
        n = range(len(self.replicas))
        if op == "stats":
            per = list(self._pool.map(lambda i: self._replica_stats(i, timeout), n))
            if not any("running" in r for r in per):
                raise EngineError(f"no replica answered 'stats' within {timeout:.0f} s"
                                  + (f" ({self.failure()})" if self.failure() else ""))
            return merge_stats(per)
        futs = [self._pool.submit(self.replicas[i].rpc, op, timeout) for i in n]
        results = []
        for i, f in enumerate(futs):
            try:
                results.append(f.result())
            except EngineError as e:
                raise EngineError(f"data-parallel replica {i}: {e}") from e
        return results

    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters requests may name (name -> folder): those every replica holds,
        less one being unloaded; None with LoRA off."""
        return None if self.loras is None else self.loras.names()

    def update_lora(self, op: str, name: str, path: str | None = None,
                    timeout: float = 120.0) -> JSON:
        """EngineClient.update_lora on every replica, which end up agreeing: load (op
        "load_lora", from folder `path`) or unload ("unload_lora") adapter `name`.
        ValueError with the reason, naming the replica, when one refuses (no replica keeps
        the change); EngineError when a replica's engine is gone. One update at a time."""
        if self._closed:
            raise EngineError("engine is not running: closed")
        if self.loras is None:
            raise ValueError("LoRA is off in this engine (--enable-lora)")
        return self.loras.update(op, name, path, timeout)

    def check_accounting(self) -> None:
        """Every replica asserts its KV page accounting (EngineError naming one that fails)."""
        self.rpc("check_accounting")

    def flush_cache(self) -> None:
        self.rpc("flush_cache")
        with self._lock:
            self.policy.forget()


def _start_all(args: ServerArgs, plan: Plan, tokenizer: Tokenizer,
               started: Sequence[StartedWorker] | None, timeout: float) -> list[EngineClient]:
    """The N clients, started in parallel; if one fails, the others are stopped and its error
    raised (naming the replica)."""
    n = args.dp_size

    def start(i: int) -> EngineClient:
        return EngineClient(args, plan, tokenizer, start_timeout=timeout,
                            started=None if started is None else started[i], replica=i)

    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="core-start") as pool:
        futs = [pool.submit(start, i) for i in range(n)]
        concurrent.futures.wait(futs)
    clients, errors = [], []
    for i, f in enumerate(futs):
        if f.exception() is None:
            clients.append(f.result())
        else:
            errors.append((i, f.exception()))
    if errors:
        for c in clients:
            c.close()
        for i, _ in errors:  # a client that failed before taking its prestarted worker
            if started is not None and started[i].process.is_alive():
                started[i].cancel()
        i, exc = errors[0]
        if isinstance(exc, EngineError):
            raise EngineError(f"data-parallel replica {i} of {n}: {exc}") from exc
        raise exc
    return clients
