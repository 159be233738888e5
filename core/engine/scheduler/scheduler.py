"""Continuous batching: a waiting queue, a running batch, chunked prefill, retraction.

One `step()`: decode every running request (one forward), then admit waiting requests into an
extend forward (prefill, possibly over a cached prefix, possibly one chunk of a long prompt).
While requests decode, that extend is cut to the prefill budget (`PrefillBudget`: the tokens
the measured extend rate fits into --decode-itl-target-ms after the decode step), so a burst of
long prompts delays the running requests' next tokens by a bounded amount.
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

The scheduler composes managers that own their state: `Queues` (where each request is),
`Pages` (rows, pages, the prefix cache), `Admission` (the extend batch, retraction, the
new-token ratio), `PrefillBudget` (the extend's cap while decoding), `Compiles` (requests
waiting for their grammar), `Overlap` (the in-flight decode step), `Speculation` (drafts and
their verification, when a proposer is given). It keeps the step itself, sampling and stop
conditions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from core.contract.grammar import forced_tokens
from core.engine.memory.memory_pool import OutOfPages, PageAllocator, ReqToTokenPool, token_slots
from core.engine.model_runner import ModelRunner
from core.engine.sampling import (
    PROMPT_LOGITS_ROWS,
    Sampler,
    SamplingParams,
    SamplingState,
    token_logprobs,
)
from core.engine.scheduler.admission import Admission
from core.engine.scheduler.budget import PrefillBudget
from core.engine.scheduler.compiles import Compiles
from core.engine.scheduler.governor import Governor
from core.engine.scheduler.overlap import InflightDecode, Overlap
from core.engine.scheduler.pages import Pages
from core.engine.scheduler.request import (
    AdmissionError,
    Queues,
    Req,
    SchedulerConfig,
    check_fits,
    new_counters,
)
from core.engine.scheduler.spec import Speculation

if TYPE_CHECKING:
    from core.contract.grammar import Grammar
    from core.contract.spec import Proposer
    from core.engine.lora import LoRAManager
    from core.engine.memory.radix_cache import NoPrefixCache, RadixCache
    from core.engine.sampling import MaskJob, TokenLogprobs


class Scheduler:
    """Drives the model runner over the requests its managers hold (see the module doc)."""

    def __init__(self, runner: ModelRunner, allocator: PageAllocator,
                 req_to_token: ReqToTokenPool, cache: RadixCache | NoPrefixCache,
                 sampler: Sampler, cfg: SchedulerConfig, eos_token_ids: Iterable[int],
                 vocab_size: int, decode_text: Callable[[list[int]], str] | None = None,
                 grammar: Grammar | None = None, proposer: Proposer | None = None,
                 proposer_grammars: bool = False, windows: Sequence[int] = (),
                 group_allocators: Sequence[PageAllocator] = (),
                 lora: LoRAManager | None = None):
        """proposer: speculative decoding's (core.contract.spec; cfg.spec_draft_tokens drafts
        per request and step at most), None: off; proposer_grammars: it can check drafts
        against a grammar (SpecCaps.grammars). windows, group_allocators: a hybrid KV pool's
        windowed groups (core.engine.memory.kv_groups; `req_to_token` has their tables).
        lora: the LoRA adapters (core.engine.lora), None: a request naming one is refused."""
        self.runner = runner
        self.sampler = sampler
        self.cfg = cfg
        self.eos = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.decode_text = decode_text  # for stop strings; None disables them
        self.grammar = grammar  # None: structured output off
        self.counters = new_counters()
        self.q = Queues()
        self.lora = lora
        self.pages = Pages(allocator, req_to_token, cache, cfg.page_size, windows,
                           group_allocators, lora)
        self.spec: Speculation | None = None
        if proposer is not None:
            if cfg.overlap:
                raise ValueError("speculative decoding runs without the overlap schedule")
            self.spec = Speculation(proposer, cfg.spec_draft_tokens, self.pages, runner,
                                    sampler, self.counters, self._accept, vocab_size,
                                    grammars=proposer_grammars,
                                    governor=Governor(cfg.spec_governor, cfg.spec_disable_batch))
        self.admission = Admission(cfg, self.q, self.pages, self.counters,
                                   on_retract=self.spec.forget if self.spec else None)
        self.budget = PrefillBudget(cfg.decode_itl_target_ms, cfg.chunked_prefill_size)
        self.compiles = Compiles(grammar, self.q, self.counters)
        self.overlap = Overlap(cfg, self.q, sampler, runner, self.counters,
                               forward=self._forward_decode, accept=self._accept,
                               decode_room=self._decode_room)
        # True under tensor parallelism: rank 0 says which compiles are done (GrammarReady,
        # broadcast), so every rank moves the same requests at the same step; else each
        # step polls
        self.grammar_by_message = False
        self._seq = 0
        self._finished_out: list[Req] = []  # finished outside a step (aborts, rejections)

    # the managers' state, read by the worker, the tests and the stats
    @property
    def waiting(self) -> list[Req]:
        return self.q.waiting

    @property
    def running(self) -> list[Req]:
        return self.q.running

    @property
    def jumped(self) -> list[Req]:
        return self.q.jumped

    @property
    def chunked(self) -> Req | None:
        return self.q.chunked

    @property
    def compiling(self) -> list[Req]:
        return self.q.compiling

    @property
    def by_id(self) -> dict[str, Req]:
        return self.q.by_id

    @property
    def inflight(self) -> InflightDecode | None:
        return self.overlap.inflight

    @property
    def allocator(self) -> PageAllocator:
        return self.pages.allocator

    @property
    def cache(self) -> RadixCache | NoPrefixCache:
        return self.pages.cache

    @property
    def new_token_ratio(self) -> float:
        return self.admission.new_token_ratio

    # -- requests in -----------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        return self.pages.pool_tokens

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        check_fits(prompt_len, max_new_tokens, self.cfg.max_context, self.pool_tokens,
                   self.cfg.page_size, self.group_limits(), self.cfg.chunked_prefill_size)

    def group_limits(self) -> tuple[tuple[int, int], ...]:
        """(window, pool tokens) of each windowed KV group (a hybrid pool), for check_fits."""
        pg = self.pages
        return tuple((w, pg.group_pool_tokens(g)) for g, w in enumerate(pg.windows, start=1))

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams | dict | None,
                    priority: int | None = None, lora: str | None = None) -> None:
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
        self.admit(rid, input_ids, p, priority, lora)

    def admit(self, rid: str, input_ids: list[int], p: SamplingParams,
              priority: int | None = None, lora: str | None = None) -> None:
        """Queue a request validated at the edge (the client, or add_request): only what depends
        on the scheduler's state is checked here (id in use, priority, queue full, structured
        output off, the LoRA adapter `lora` names loaded). A constraint whose grammar is cached
        gets its matcher now; a new one parks the request while a compile process compiles it
        (no grammar library on this thread)."""
        q = self.q
        lora_id = None
        try:
            if lora is not None:
                if self.lora is None:
                    raise AdmissionError(f"LoRA adapter {lora!r} asked for, but LoRA is off "
                                         "in this engine (--enable-lora)")
                try:
                    lora_id = self.lora.lookup(lora)
                except ValueError as exc:
                    raise AdmissionError(str(exc), status=404) from None
            if rid in q.by_id:
                raise AdmissionError(f"request id {rid!r} is already in use")
            if priority is not None and not self.admission.honours_priority:
                raise AdmissionError("request priority given but priority scheduling is off "
                                     "(--enable-priority-scheduling)")
            cap = self.cfg.max_queued_requests
            # waiting requests that free running slots will take at the next step are about to
            # run, not queued: a burst of max_running + max_queued is accepted whole
            slots = (self.cfg.max_running_requests - len(q.running) - len(q.jumped)
                     - (q.chunked is not None))
            queued = len(q.waiting) + len(q.compiling) - max(slots, 0)
            if cap is not None and queued >= cap:
                raise AdmissionError(f"the queue is full: {queued} requests waiting "
                                     f"(--max-queued-requests {cap})", status=503)
            if p.constraint is not None and self.grammar is None:
                raise AdmissionError("structured output is off in this engine "
                                     "(--grammar-backend none, or no grammar backend fits)")
        except ValueError:
            self.counters["rejected"] += 1
            raise
        stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))
        state = SamplingState(p, input_ids, stop_ids, self.vocab_size, self.runner.device)
        compiled = self.grammar.cached(p.constraint) if p.constraint is not None else None
        if compiled is not None:
            state.matcher = self.grammar.matcher_of(compiled)
        req = Req(rid, list(input_ids), p, state, self._seq, priority or 0, lora_id=lora_id)
        self._seq += 1
        q.by_id[rid] = req
        if p.constraint is not None and compiled is None:
            self.compiles.park(req)
        else:
            q.waiting.append(req)

    # -- grammar compiles ------------------------------------------------------------------------

    def grammar_ready(self) -> list[int]:
        """The ids of the compiles that are done (in start order)."""
        return self.compiles.ready()

    def grammar_done(self, ids: list[int]) -> None:
        """Move the requests of these finished compiles on (Compiles.done); the refused ones
        finish with the compile's error."""
        for req in self.compiles.done(ids):
            self._done(req)
            self._finished_out.append(req)

    def poll_timeout(self) -> float:
        """How long the worker may wait for messages before the next step: 0 with work to do,
        a moment while only grammar compiles are pending, else half a second."""
        q = self.q
        if q.waiting or q.running or q.chunked or q.jumped or self._finished_out \
                or self.inflight is not None:
            return 0.0
        return 0.002 if q.compiling else 0.5

    def abort(self, rid: str) -> bool:
        q = self.q
        req = q.by_id.get(rid)
        if req is None or req.finish is not None:
            return False
        if req.compile_id is not None:
            self.compiles.leave(req)
        elif req in q.waiting:
            q.waiting.remove(req)
        else:
            if req is q.chunked:
                q.chunked = None
            elif req in q.running:
                q.running.remove(req)
            elif req.jumping:
                q.unjump(req)
            self.pages.release(req)
        req.finish = {"type": "abort", "message": "aborted by the client"}
        self.counters["aborted"] += 1
        self._done(req)
        self._finished_out.append(req)
        return True

    # -- one step --------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        q = self.q
        return bool(q.waiting or q.running or q.chunked or q.jumped or self._finished_out
                    or self.inflight is not None or q.compiling)

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
        if self.compiles and not self.grammar_by_message:
            self.grammar_done(self.grammar_ready())
        touched: list[Req] = self._finished_out
        self._finished_out = []
        if self.inflight is not None:
            if self.overlap.can_chain():
                return touched + self.overlap.chain()
            touched += self.overlap.land()
        if self.q.running:
            touched += self._decode_step()
        touched += self._extend_step()
        return touched

    # -- plain steps -----------------------------------------------------------------------------

    def _decode_pages_needed(self) -> int:
        """New pages the running batch needs for one more token each."""
        ps = self.cfg.page_size
        return sum(1 for r in self.q.running if r.kv_len % ps == 0)

    def _decode_room(self) -> bool:
        return self.pages.ensure(self._decode_pages_needed())

    def _forward_decode(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One decode forward of the running batch (pages already ensured) -> logits [B, V].
        input_ids: host ints, or the previous step's device tokens (overlap)."""
        ps = self.cfg.page_size
        batch = self.q.running
        pg = self.pages
        slots, positions = [], []
        gslots: list[list[int]] = [[] for _ in pg.windows]
        for r in batch:
            if r.kv_len % ps == 0:
                pg.add_pages(r, 1)
            slots.append(token_slots(r.pages, r.kv_len, r.kv_len + 1, ps)[0])
            for gs, w in zip(gslots, r.wpages, strict=True):
                gs.append(token_slots(w, r.kv_len, r.kv_len + 1, ps)[0])
            positions.append(r.kv_len)
        logits = self.runner.decode([r.row for r in batch], input_ids, positions, slots,
                                    group_slots=gslots, lora=self._lora_slots(batch))
        for r in batch:
            r.kv_len += 1
            if pg.windows:
                pg.trim(r)
        self.counters["decode_tokens"] += len(batch)
        self.admission.decayed()
        return logits

    def _lora_slots(self, reqs: Sequence[Req]) -> list[int] | None:
        """Each request's LoRA slot for the runner (None: LoRA off)."""
        return None if self.lora is None else [r.lora_slot for r in reqs]

    def _decode_step(self) -> list[Req]:
        while not self._decode_room():
            victim = self.admission.pick_victim()
            if victim is None:  # cannot happen for admitted requests; never loop forever
                raise OutOfPages("decode cannot get a KV page and has nothing to retract")
            self.admission.retract(victim)
        q = self.q
        if not q.running:
            return []
        if self.overlap.deferrable():
            self.overlap.launch([r.output_ids[-1] for r in q.running])
            return []
        batch = q.running
        clock = self.budget.clock
        tb = clock()  # the budget's clock: the whole decode part of the step (proposing too)
        if self.spec is not None and self._speculate(batch):
            if self.budget.measuring:
                self.budget.decode_timed(clock() - tb)
            q.running = q.decoding(batch)
            return list(batch)
        # Grammar masks: where the forward runs on the host (no overlap schedule: a CPU) they
        # fill on a host thread meanwhile; where it runs on a device they fill in this thread
        # after the forward's launch, while the device computes (at sampling).
        masks = None if self.cfg.overlap else self.sampler.start_masks(
            [r.state for r in batch], self.vocab_size)
        t0 = time.perf_counter()
        logits = self._forward_decode([r.output_ids[-1] for r in batch])
        self._sample(batch, logits, masks)  # the tokens on the host: the step is over
        if self.spec is not None:  # a plain step's cost, beside the verify steps' (governor)
            self.spec.governor.step_timed(len(batch), time.perf_counter() - t0)
        if self.budget.measuring:
            self.budget.decode_timed(clock() - tb)
        q.running = q.decoding(batch)
        return list(batch)

    def _speculate(self, batch: list[Req]) -> bool:
        """A verify step over the batch when a request has drafts and their pages are there
        (else False: a plain decode step; never a retraction for drafts' sake)."""
        drafts = self.spec.propose(batch)
        if drafts is None or not self.pages.ensure(self.spec.pages_needed(batch, drafts)):
            return False
        self.spec.verify(batch, drafts)
        self.admission.decayed()
        return True

    def _extend_step(self) -> list[Req]:
        self.admission.preempt_for_priority()
        q, pg, budget = self.q, self.pages, self.budget
        decoding = bool(q.running)
        cap = budget.cap(decoding)
        items = self.admission.admit(cap)
        if not items:
            return []
        clock = budget.clock
        t0 = clock()
        rows, prefix, tokens, slots, ready = [], [], [], [], []
        gslots: list[list[list[int]]] = [[] for _ in pg.windows]
        for i, (r, n) in enumerate(items):
            all_ids = r.all_ids
            rows.append(r.row)
            prefix.append(r.kv_len)
            tokens.append(all_ids[r.kv_len:r.kv_len + n])
            full, windowed = pg.slots(r, r.kv_len, r.kv_len + n)
            slots.append(full)
            for gs, ws in zip(gslots, windowed, strict=True):
                gs.append(ws)
            if r.kv_len + n == r.fill_len:
                ready.append(i)
        want = [i for i, (r, _) in enumerate(items) if r.wants_prompt_lps]
        hidden: dict[int, torch.Tensor] = {}
        logits = self.runner.extend(rows, prefix, tokens, slots, ready, want, hidden,
                                    group_slots=gslots,
                                    lora=self._lora_slots([r for r, _ in items]))
        for i in want:
            self._prompt_logprobs(items[i][0], prefix[i], hidden[i])
        for r, n in items:
            r.kv_len += n
            pg.trim(r)
        n_tokens = sum(n for _, n in items)
        self.counters["prefill_tokens"] += n_tokens
        done = [items[i][0] for i in ready]
        if q.chunked is not None and q.chunked.kv_len == q.chunked.fill_len:
            q.chunked = None
        if done:
            self._sample(done, logits)  # the tokens on the host: the forward is over
            q.running += q.decoding(done)
        # timed when sampling waited for the device anyway, or while decodes wait for this
        # extend (then the device is waited for here, or the next decode would pay for it)
        if budget.measuring and (done or decoding or budget.seconds_per_token is None):
            if not done:
                self.runner.platform.synchronize(self.runner.device)
            budget.extend_timed(n_tokens, clock() - t0)
        if cap is not None:
            budget.last = cap
            if n_tokens >= cap and cap < self.cfg.chunked_prefill_size and (
                    q.chunked is not None or q.waiting):
                budget.capped_steps += 1
        return done

    def _prompt_logprobs(self, r: Req, start: int, hidden: torch.Tensor) -> None:
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

    def _sample(self, reqs: list[Req], logits, masks: MaskJob | None = None) -> None:
        out = self.sampler.sample(logits, [r.state for r in reqs], masks)
        for r, tok, lp in zip(reqs, out.tokens, out.logprobs, strict=True):
            self._accept(r, tok, lp)

    def _accept(self, r: Req, tok: int, lp: TokenLogprobs | None) -> None:
        """A sampled token joins r's output; finish (and hand back its KV) if it stops; with
        jump-forward, the tokens its grammar forces next join too (`_jump`)."""
        r.output_ids.append(tok)
        r.pending_ids.append(tok)
        if r.params.logprobs:
            r.pending_lps.append(lp)
        m = r.state.matcher
        if m is not None and not m.accept(tok):
            r.finish = self._refused(r, tok)
        else:
            r.finish = self._check_finish(r, tok)
            if r.finish is None and m is not None and self.cfg.jump_forward \
                    and not r.params.logprobs:
                self._jump(r)
        if r.finish is not None:
            self.pages.release(r)
            self.counters["finished"] += 1
            self._done(r)

    def _refused(self, r: Req, tok: int) -> dict[str, str | int]:
        """r's grammar refused its sampled token: either it allows no token at all here (a
        dead end the backend could not see at compile time: the constraint can never be
        completed, a 400 naming it) or its mask allowed the token (a backend bug, a 500)."""
        mask = torch.zeros((1, -(-self.vocab_size // 32)), dtype=torch.int32)
        r.state.matcher.fill_bitmask(mask, 0)
        if any(mask[0].tolist()):
            return {"type": "abort", "status_code": 500,
                    "message": f"the grammar refused sampled token {tok}, which its mask "
                               "allowed (a grammar backend bug)"}
        c = r.params.constraint
        return {"type": "abort", "status_code": 400,
                "message": f"{c.where}: the constraint can never be satisfied: after "
                           f"{len(r.output_ids) - 1} tokens its grammar allows no next token, "
                           "not even an end"}

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
            self.q.jumped.append(r)

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

    def _done(self, req: Req) -> None:
        self.q.by_id.pop(req.rid, None)
        if self.spec is not None:
            self.spec.forget(req)
        if req.state.matcher is not None:  # finished or aborted: its grammar state goes
            req.state.matcher.close()
            req.state.matcher = None

    # -- introspection ---------------------------------------------------------------------------

    def check_accounting(self) -> None:
        """Assert free + cached + in use == total pages, with no page owned twice."""
        self.pages.check_accounting(self.q.holding())
        if self.spec is not None:
            self.spec.check_accounting({r.rid for r in self.q.holding()})

    def stats(self) -> dict[str, int | float]:
        q, cache = self.q, self.pages.cache
        groups = {}
        for g, alloc in enumerate(self.pages.group_allocators, start=1):
            # a hybrid pool's windowed groups (group 0's are the keys below; their windows are
            # in the engine's notes): counts only, which add up over data-parallel replicas
            groups.update({f"kv_group{g}_free_pages": alloc.free_pages,
                           f"kv_group{g}_total_pages": alloc.total_pages,
                           f"kv_group{g}_evictable_pages": cache.group_evictable(g)})
        return {**self.counters, **groups,
                **(self.lora.stats() if self.lora is not None else {}),
                **(self.spec.stats() if self.spec is not None else {}),
                "running": len(q.holding()),
                "waiting": len(q.waiting),
                "compiling": len(q.compiling),
                "free_pages": self.pages.allocator.free_pages,
                "total_pages": self.pages.allocator.total_pages,
                "page_size": self.cfg.page_size,
                "cached_pages": cache.evictable_pages + cache.protected_pages,
                "evictable_pages": cache.evictable_pages,  # reusable: the server counts
                # them as free in its kv_pages_used (as SGLang does)
                "new_token_ratio": round(self.admission.new_token_ratio, 4),
                # the prefill budget while decoding: target, latest cap, capped extends, and
                # the measurements it comes from (core.engine.scheduler.budget)
                **self.budget.stats(),
                # grammar masks: seconds filled, seconds the step waited on them, count
                **self.sampler.mask_stats,
                # grammar compiles: queued, running, outcomes (core.engine.grammar_compiler)
                **(self.grammar.stats() if self.grammar is not None else {})}
