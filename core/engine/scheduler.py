"""Continuous batching: a waiting queue, a running batch, chunked prefill, retraction.

One `step()`: decode every running request (one forward), then admit waiting requests into an
extend forward (prefill, possibly over a cached prefix, possibly one chunk of a long prompt).
Admission keeps a reserve of KV for the running requests' future tokens (SGLang's new-token
ratio, scaled by --schedule-conservativeness). If decode still runs out of pages, running requests
are retracted: their KV goes to the prefix cache (or is freed), and they wait to be recomputed
from prompt + generated tokens; their output so far is kept, so nothing is lost or changed.
With priority scheduling, a waiting request that cannot be admitted preempts running requests
whose priority is lower than its own by at least --priority-scheduling-preemption-threshold
(retracted the same way, lowest priority first).
With jump-forward, the tokens a request's grammar forces after its sampled token join its output
at once; the request leaves the decode batch for one extend of those tokens (`jumped`, keeping
its KV), whose last position samples its next token, and rejoins the batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.contract.grammar import forced_tokens
from core.engine.admission import CLIP_MAX_NEW_TOKENS, Admission, AdmissionError, check_fits
from core.engine.memory.memory_pool import OutOfPages, PageAllocator, ReqToTokenPool, token_slots
from core.engine.memory.radix_cache import NoPrefixCache, RadixCache
from core.engine.model_runner import ModelRunner
from core.engine.overlap import InflightDecode, Overlap
from core.engine.sampling import (
    PROMPT_LOGITS_ROWS,
    Sampler,
    SamplingParams,
    SamplingState,
    token_logprobs,
)

__all__ = ["AdmissionError", "CLIP_MAX_NEW_TOKENS", "InflightDecode", "Req", "Scheduler",
           "SchedulerConfig", "check_fits"]


@dataclass
class SchedulerConfig:
    page_size: int
    max_context: int
    max_running_requests: int
    max_queued_requests: int | None = None
    chunked_prefill_size: int | None = None  # None: no chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    # a waiting request preempts running ones whose priority is lower by at least this much
    priority_preemption_threshold: int = 10
    schedule_conservativeness: float = 1.0
    seed: int = 0
    overlap: bool = False  # launch decode step N+1 before the host sees step N's tokens
    jump_forward: bool = False  # append grammar-forced tokens, computed by one extend


@dataclass
class Req:
    """A request as the scheduler sees it (token ids only; text lives with the client)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    state: SamplingState
    seq: int  # arrival order
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    # KV memory
    row: int = -1  # req_to_token row while admitted
    pages: list[int] = field(default_factory=list)  # covers tokens [0, kv_len)
    num_shared: int = 0  # leading pages owned by the prefix cache (locked through `node`)
    node: Any = None
    kv_len: int = 0  # tokens whose K/V is in the pool
    fill_len: int = 0  # tokens to cache before the next sample (prompt + output at admission)
    cached_tokens: int = -1  # prefix-cache hit of the first admission (reported)
    compile_id: int | None = None  # its grammar's compile while it is in `compiling`
    jumps: int = 0  # jump-forwards so far (an overlap step launched before one drops its token)
    jumping: bool = False  # in `jumped`: its forced tokens wait for their extend
    finish: dict | None = None
    # output not yet reported: new ids and their logprobs
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[Any] = field(default_factory=list)
    # prompt_logprobs: (logprob, top) of prompt tokens 1.. as prefill computes them; reported
    # once, with the first output
    prompt_lps: list[Any] = field(default_factory=list)
    prompt_lps_sent: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def remaining_new(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def wants_prompt_lps(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (the prefill must not start from
        a cached prefix: its positions' logits are needed)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_lps) < len(self.prompt_ids) - 1)


class Scheduler(Admission, Overlap):
    """Owns the waiting queue, the running batch and the KV pages; drives the model runner.

    Its seams live beside it: which waiting requests run and who gives KV back (core.engine.admission),
    and decode steps launched before the last one was read (core.engine.overlap)."""

    def __init__(self, runner: ModelRunner, allocator: PageAllocator,
                 req_to_token: ReqToTokenPool, cache: RadixCache | NoPrefixCache,
                 sampler: Sampler, cfg: SchedulerConfig, eos_token_ids: Iterable[int],
                 vocab_size: int, decode_text: Callable[[list[int]], str] | None = None,
                 grammar: Any = None):
        self.runner = runner
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.cache = cache
        self.sampler = sampler
        self.cfg = cfg
        self.eos = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.decode_text = decode_text  # for stop strings; None disables them
        self.grammar = grammar  # core.contract.grammar.Grammar for constrained requests; None: off
        self.waiting: list[Req] = []
        # constrained requests whose grammar is being compiled on the grammar's thread (off
        # the step); they join `waiting` when it is done (grammar_done)
        self.compiling: list[Req] = []
        self._compiles: dict[int, tuple[Any, Any, list[Req]]] = {}  # id: (constraint, future,
        self._compile_ids: dict[tuple[str, str], int] = {}  # reqs); constraint key: id
        self._next_compile = 0
        # True under tensor parallelism: rank 0 says which compiles are done (GrammarReady,
        # broadcast), so every rank moves the same requests at the same step; else each
        # step polls
        self.grammar_by_message = False
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is being prefilled in chunks
        # jump-forward: requests whose grammar-forced tokens joined their output and wait for
        # the extend that computes them (they keep their row and pages)
        self.jumped: list[Req] = []
        self.by_id: dict[str, Req] = {}
        self._seq = 0
        self._rng = random.Random(cfg.seed)
        self.init_ratio = min(0.7 * cfg.schedule_conservativeness, 1.0)
        self.min_ratio = min(0.1 * cfg.schedule_conservativeness, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / 600
        self.new_token_ratio = self.init_ratio
        self.counters = {"retractions": 0, "rejected": 0, "prefill_tokens": 0,
                         "decode_tokens": 0, "cached_tokens": 0, "finished": 0, "aborted": 0,
                         "steps": 0, "overlapped_steps": 0, "preemptions": 0,
                         "jumps": 0, "jump_tokens": 0}
        self._finished_out: list[Req] = []  # finished outside a step (aborts, rejections)
        self.inflight: InflightDecode | None = None  # overlap: the step whose tokens are out

    # -- admission -------------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        return self.allocator.total_pages * self.cfg.page_size

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        check_fits(prompt_len, max_new_tokens, self.cfg.max_context, self.pool_tokens,
                   self.cfg.page_size)

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams | dict | None,
                    priority: int | None = None) -> None:
        """Validate (for in-process callers: this is their edge), then admit; raises
        AdmissionError (or ValueError for bad parameters)."""
        try:
            p = SamplingParams.from_dict(params)
            p.check_vocab(self.vocab_size)
            bad = [t for t in input_ids if not isinstance(t, int) or not
                   0 <= t < self.vocab_size]
            if bad:
                raise AdmissionError(f"input_ids {bad[:5]} are outside the vocabulary of "
                                     f"{self.vocab_size}")
            self.check_fits(len(input_ids), p.max_new_tokens)
        except ValueError:
            self.counters["rejected"] += 1
            raise
        self.admit(rid, input_ids, p, priority)

    def admit(self, rid: str, input_ids: list[int], p: SamplingParams,
              priority: int | None = None) -> None:
        """Queue a request validated at the edge (the client, or add_request): only what depends
        on the scheduler's state is checked here (id in use, priority, queue full)."""
        try:
            if rid in self.by_id:
                raise AdmissionError(f"request id {rid!r} is already in use")
            if priority is not None and not self._honours_priority:
                raise AdmissionError("request priority given but priority scheduling is off "
                                     "(--enable-priority-scheduling)")
            cap = self.cfg.max_queued_requests
            # waiting requests that free running slots will take at the next step are about to
            # run, not queued: a burst of max_running + max_queued is accepted whole
            slots = (self.cfg.max_running_requests - len(self.running) - len(self.jumped)
                     - (self.chunked is not None))
            queued = len(self.waiting) + len(self.compiling) - max(slots, 0)
            if cap is not None and queued >= cap:
                raise AdmissionError(f"the queue is full: {queued} requests waiting "
                                     f"(--max-queued-requests {cap})", status=503)
        except ValueError:
            self.counters["rejected"] += 1
            raise
        stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))
        state = SamplingState(p, input_ids, stop_ids, self.vocab_size, self.runner.device)
        compiled = self._grammar_for(p) if p.constraint is not None else None
        if compiled is not None:
            state.matcher = self.grammar.matcher_of(compiled)
        req = Req(rid, list(input_ids), p, state, self._seq, priority or 0)
        self._seq += 1
        self.by_id[rid] = req
        if p.constraint is not None and compiled is None:
            self._compile(req)
        else:
            self.waiting.append(req)

    def _grammar_for(self, p: SamplingParams) -> Any:
        """The constraint's compiled grammar from the cache, or None (to be compiled). The
        edge checked the constraint (Grammar.check); no grammar library runs on this thread:
        a new constraint compiles in a compile process (core.engine.grammar_compiler)."""
        if self.grammar is None:
            self.counters["rejected"] += 1
            raise AdmissionError("structured output is off in this engine "
                                 "(--grammar-backend none, or no grammar backend fits)")
        return self.grammar.cached(p.constraint)

    def _compile(self, req: Req) -> None:
        """Park `req` in `compiling` on its grammar's compile (one per constraint at a time)."""
        key = req.params.constraint.key()
        cid = self._compile_ids.get(key)
        if cid is None:
            cid = self._compile_ids[key] = self._next_compile
            self._next_compile += 1
            self._compiles[cid] = (req.params.constraint,
                                   self.grammar.submit(req.params.constraint), [])
        self._compiles[cid][2].append(req)
        req.compile_id = cid
        self.compiling.append(req)

    def grammar_ready(self) -> list[int]:
        """The ids of the compiles that are done (in start order)."""
        return [cid for cid, (_, fut, _) in self._compiles.items() if fut.done()]

    def grammar_done(self, ids: list[int]) -> None:
        """Move the requests of these finished compiles on: to `waiting` with their matcher,
        or finished with the compile's error (400 for a refusal, 500 for a backend failure).
        Waits for a compile not yet done here (a rank told by rank 0)."""
        for cid in ids:
            constraint, fut, reqs = self._compiles.pop(cid)
            del self._compile_ids[constraint.key()]
            try:
                compiled = fut.result()
            except ValueError as exc:
                compiled, error = None, exc
            else:
                self.grammar.store(constraint, compiled)
            for req in reqs:
                if req.compile_id != cid or req not in self.compiling:
                    continue  # aborted while compiling
                self.compiling.remove(req)
                req.compile_id = None
                if compiled is not None:
                    req.state.matcher = self.grammar.matcher_of(compiled)
                    self.waiting.append(req)
                    continue
                self.counters["rejected"] += 1
                req.finish = {"type": "abort", "message": str(error),
                              "status_code": getattr(error, "status", 400)}
                self._done(req)
                self._finished_out.append(req)

    def poll_timeout(self) -> float:
        """How long the worker may wait for messages before the next step: 0 with work to do,
        a moment while only grammar compiles are pending, else half a second."""
        if self.waiting or self.running or self.chunked or self.jumped or self._finished_out \
                or self.inflight is not None:
            return 0.0
        return 0.002 if self.compiling else 0.5

    def abort(self, rid: str) -> bool:
        req = self.by_id.get(rid)
        if req is None or req.finish is not None:
            return False
        if req in self.compiling:
            self.compiling.remove(req)
            cid, req.compile_id = req.compile_id, None
            constraint, fut, reqs = self._compiles[cid]
            reqs.remove(req)
            if not reqs:  # nobody waits for it: stop it (every rank does the same)
                del self._compiles[cid], self._compile_ids[constraint.key()]
                self.grammar.cancel(fut)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            if req is self.chunked:
                self.chunked = None
            elif req in self.running:
                self.running.remove(req)
            elif req.jumping:
                self._unjump(req)
            self._release(req)
        req.finish = {"type": "abort", "message": "aborted by the client"}
        self.counters["aborted"] += 1
        self._done(req)
        self._finished_out.append(req)
        return True

    # -- one step --------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.jumped
                    or self._finished_out or self.inflight is not None or self.compiling)

    def step(self) -> list[Req]:
        """Run one scheduling step; return the requests with new output (or just finished).

        With `overlap`, a decode-only step launches its forward and sampling and returns before
        the sampled tokens reach the host; the next step launches the following decode on those
        device tokens first, then lands the previous step's tokens (stop checks, outputs) while
        the device works. A request found finished on landing has had one extra token computed
        and dropped. Anything else (new requests, chunked prefill, retraction, penalties,
        logprobs) lands the in-flight step first and runs as without overlap.
        """
        self.counters["steps"] += 1
        if self._compiles and not self.grammar_by_message:
            self.grammar_done(self.grammar_ready())
        touched: list[Req] = self._finished_out
        self._finished_out = []
        if self.inflight is not None:
            if self._can_chain():
                return touched + self._chain_decode()
            touched += self._land()
        if self.running:
            touched += self._decode_step()
        touched += self._extend_step()
        return touched

    # -- plain steps -----------------------------------------------------------------------------

    def _decode_pages_needed(self) -> int:
        """New pages the running batch needs for one more token each."""
        ps = self.cfg.page_size
        return sum(1 for r in self.running if r.kv_len % ps == 0)

    def _forward_decode(self, input_ids: Any) -> Any:
        """One decode forward of self.running (pages already ensured) -> logits [B, V].
        input_ids: host ints, or the previous step's device tokens (overlap)."""
        ps = self.cfg.page_size
        batch = self.running
        slots, positions = [], []
        for r in batch:
            if r.kv_len % ps == 0:
                r.pages.extend(self.allocator.alloc(1))
            slots.append(token_slots(r.pages, r.kv_len, r.kv_len + 1, ps)[0])
            positions.append(r.kv_len)
        logits = self.runner.decode([r.row for r in batch], input_ids, positions, slots)
        for r in batch:
            r.kv_len += 1
        self.counters["decode_tokens"] += len(batch)
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        return logits

    def _decode_step(self) -> list[Req]:
        while not self._ensure_pages(self._decode_pages_needed()):
            victim = self._pick_victim()
            if victim is None:  # cannot happen for admitted requests; never loop forever
                raise OutOfPages("decode cannot get a KV page and has nothing to retract")
            self._retract(victim)
        if not self.running:
            return []
        if self._deferrable():
            self._launch_decode([r.output_ids[-1] for r in self.running])
            return []
        batch = self.running
        # Grammar masks: where the forward runs on the host (no overlap schedule: a CPU) they
        # fill on a host thread meanwhile; where it runs on a device they fill in this thread
        # after the forward's launch, while the device computes (at sampling).
        masks = None if self.cfg.overlap else self.sampler.start_masks(
            [r.state for r in batch], self.vocab_size)
        logits = self._forward_decode([r.output_ids[-1] for r in batch])
        self._sample(batch, logits, masks)
        self.running = self._decoding(batch)
        return list(batch)

    def _extend_step(self) -> list[Req]:
        self._preempt_for_priority()
        items = self._admit()
        if not items:
            return []
        ps = self.cfg.page_size
        rows, prefix, tokens, slots, ready = [], [], [], [], []
        for i, (r, n) in enumerate(items):
            all_ids = r.all_ids
            rows.append(r.row)
            prefix.append(r.kv_len)
            tokens.append(all_ids[r.kv_len:r.kv_len + n])
            slots.append(token_slots(r.pages, r.kv_len, r.kv_len + n, ps))
            if r.kv_len + n == r.fill_len:
                ready.append(i)
        want = [i for i, (r, _) in enumerate(items) if r.wants_prompt_lps]
        hidden: dict[int, Any] = {}
        logits = self.runner.extend(rows, prefix, tokens, slots, ready, want, hidden)
        for i in want:
            self._prompt_logprobs(items[i][0], prefix[i], hidden[i])
        for r, n in items:
            r.kv_len += n
        self.counters["prefill_tokens"] += sum(n for _, n in items)
        done = [items[i][0] for i in ready]
        if self.chunked is not None and self.chunked.kv_len == self.chunked.fill_len:
            self.chunked = None
        if done:
            self._sample(done, logits)
            self.running += self._decoding(done)
        return done

    def _prompt_logprobs(self, r: Req, start: int, hidden: Any) -> None:
        """Logprobs of the prompt tokens that follow positions start.. (their hidden states
        from this extend), computed PROMPT_LOGITS_ROWS positions at a time."""
        if start > len(r.prompt_lps):  # cannot happen: such requests take no cached prefix
            raise RuntimeError(f"request {r.rid}: prompt logprobs from position {start} but "
                               f"only {len(r.prompt_lps)} computed")
        del r.prompt_lps[start:]  # recomputed after a retraction in the middle of its prompt
        end = min(start + hidden.shape[0], len(r.prompt_ids) - 1)  # the last one has no next
        k = r.params.prompt_logprobs
        for a in range(start, end, PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, end)
            logits = self.runner.logits(hidden[a - start:b - start])
            nxt = torch.tensor(r.prompt_ids[a + 1:b + 1], dtype=torch.long)
            r.prompt_lps.extend(token_logprobs(logits, nxt, k))

    # -- sampling and stop conditions ------------------------------------------------------------

    def _sample(self, reqs: list[Req], logits, masks: Any = None) -> None:
        out = self.sampler.sample(logits, [r.state for r in reqs], masks)
        for r, tok, lp in zip(reqs, out.tokens, out.logprobs, strict=True):
            self._accept(r, tok, lp)

    def _accept(self, r: Req, tok: int, lp: Any) -> None:
        """A sampled token joins r's output; finish (and hand back its KV) if it stops; with
        jump-forward, the tokens its grammar forces next join too (`_jump`)."""
        r.output_ids.append(tok)
        r.pending_ids.append(tok)
        if r.params.logprobs:
            r.pending_lps.append(lp)
        m = r.state.matcher
        if m is not None and not m.accept(tok):  # the mask allowed it: a backend bug
            r.finish = {"type": "abort", "message": f"the grammar refused sampled token {tok}"}
        else:
            r.finish = self._check_finish(r, tok)
            if r.finish is None and m is not None and self.cfg.jump_forward \
                    and not r.params.logprobs:
                self._jump(r)
        if r.finish is not None:
            self._release(r)
            self.counters["finished"] += 1
            self._done(r)

    def _jump(self, r: Req) -> None:
        """Jump-forward: the tokens r's grammar forces after its last token join its output
        (stop checks per token, as if sampled); r then waits in `jumped` for the extend that
        computes them. A request asking for logprobs is never jumped (forced tokens have no
        model logprobs)."""
        forced = forced_tokens(r.state.matcher, r.remaining_new())
        for tok in forced:
            r.output_ids.append(tok)
            r.pending_ids.append(tok)
            r.state.observe(tok)
            r.finish = self._check_finish(r, tok)
            if r.finish is not None:
                break
        if forced:
            r.jumps += 1
            self.counters["jumps"] += 1
            self.counters["jump_tokens"] += len(forced)
        if forced and r.finish is None:
            r.jumping = True
            self.jumped.append(r)

    def _unjump(self, r: Req) -> None:
        r.jumping = False
        self.jumped = [x for x in self.jumped if x is not r]

    def _decoding(self, reqs: list[Req]) -> list[Req]:
        """Those of `reqs` that go on decoding: not finished, not waiting for a jump's extend."""
        return [r for r in reqs if r.finish is None and not r.jumping]

    def _check_finish(self, r: Req, tok: int) -> dict | None:
        p = r.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return {"type": "stop", "matched": tok}
        if r.state.matcher is not None and r.state.matcher.is_terminated():
            return {"type": "stop", "matched": tok}
        if p.stop and self.decode_text is not None and len(r.output_ids) >= p.min_new_tokens:
            longest = max(len(s) for s in p.stop)
            # A stop string of L characters spans at most L tokens (plus a few partial bytes).
            window = r.output_ids[-(longest + 4):]
            tail = self.decode_text(window)
            # While the window still holds tokens from before min_new_tokens, a stop string
            # counts only if this token completed it (earlier occurrences are plain text).
            early = len(r.output_ids) - len(window) < p.min_new_tokens
            prev = self.decode_text(window[:-1]) if early else ""
            for s in p.stop:
                if s in tail and (not early or tail.count(s) > prev.count(s)):
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    # -- introspection ---------------------------------------------------------------------------

    def in_use_pages(self) -> list[int]:
        return [p for r in self._holding() for p in r.pages[r.num_shared:]]

    def check_accounting(self) -> None:
        """Assert free + cached + in use == total pages, with no page owned twice."""
        self.allocator.check_accounting(self.cache.cached_pages(), self.in_use_pages())
        rows = len(self._holding())
        assert self.req_to_token.free_rows + rows == self.req_to_token.max_reqs, \
            f"request rows leaked: {self.req_to_token.free_rows} free + {rows} held != " \
            f"{self.req_to_token.max_reqs}"

    def stats(self) -> dict[str, Any]:
        return {**self.counters,
                "running": len(self._holding()),
                "waiting": len(self.waiting),
                "compiling": len(self.compiling),
                "free_pages": self.allocator.free_pages,
                "total_pages": self.allocator.total_pages,
                "page_size": self.cfg.page_size,
                "cached_pages": self.cache.evictable_pages + self.cache.protected_pages,
                "evictable_pages": self.cache.evictable_pages,  # reusable: the server counts
                # them as free in its kv_pages_used (as SGLang does)
                "new_token_ratio": round(self.new_token_ratio, 4),
                # grammar masks: seconds filled, seconds the step waited on them, count
                **self.sampler.mask_stats,
                # grammar compiles: queued, running, outcomes (core.engine.grammar_compiler)
                **(self.grammar.stats() if self.grammar is not None else {})}
