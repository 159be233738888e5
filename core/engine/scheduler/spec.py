"""Speculative decoding in the scheduler: drafts for the decode batch from the plan's proposer
(core.contract.spec), verified by one forward of the target over each request's
[last token + drafts], exactly.

A decode step with speculation: every running request asks the proposer for up to
`budget(req)` drafts (the flag's number, bounded by what is left of max_new_tokens, so no
request ever computes or emits past it), as many of them as the governor
(core.engine.scheduler.governor, --speculative-governor on) finds worth their cost. When no
request has a draft the step is a plain decode (graphs included). Otherwise one extend-like forward runs every request
(those without drafts with their one token), with pages for all its tokens; position j of a
request is verified with its drafts 0..j-1 observed first (penalties, min_new_tokens), by
Sampler.verify: greedy by exact match, sampled by rejection sampling. A request emits its
accepted drafts and one token of the target's (the correction, or the bonus after all were
accepted); stop conditions run per emitted token, and what follows a stop is dropped. K/V of the
accepted tokens stays; the pages that only held rejected drafts go back to the allocator before
anything else sees the request, so the pool and the prefix cache never hold a rejected token.

Constrained requests (a grammar matcher) decode without drafts when the proposer cannot check
drafts against a grammar (SpecCaps.grammars); each such request is counted once
(spec_skipped_grammar) and its meta_info says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from core.contract.spec import DraftRequest, Proposer
from core.engine.scheduler.governor import Governor

if TYPE_CHECKING:
    from core.engine.draft import DraftModelRunner
    from core.engine.model_runner import ModelRunner
    from core.engine.sampling import Sampler, TokenLogprobs
    from core.engine.scheduler.pages import Pages
    from core.engine.scheduler.request import Req

GRAMMAR_NOTE = "speculation off for this request: its proposer cannot check drafts against a " \
               "grammar"


class Speculation:
    """Proposes drafts for the decode batch and verifies them in one forward."""

    def __init__(self, proposer: Proposer, num_draft_tokens: int, pages: Pages,
                 runner: ModelRunner, sampler: Sampler, counters: dict[str, int],
                 accept: Callable[[Req, int, TokenLogprobs | None], None],
                 vocab_size: int, grammars: bool = False, governor: Governor | None = None):
        """accept(req, token, logprobs): the scheduler's, one emitted token joins the output
        (stop checks, finishing). Drafts must lie below vocab_size. governor: drafts per
        request and step (None: one that is off, the flag's number every step)."""
        self.proposer, self.num_draft_tokens = proposer, num_draft_tokens
        self.pages, self.runner, self.sampler = pages, runner, sampler
        self.counters, self.accept, self.grammars = counters, accept, grammars
        self.vocab_size = vocab_size
        self.governor = governor if governor is not None else Governor(on=False)
        # the engine's draft model (core.engine.draft), where the proposer runs one: its pool's
        # accounting and stats
        self.draft: DraftModelRunner | None = None
        # the stats' spec_* counts, present only while speculation is on (/metrics shows
        # core_spec_decode_*_total then)
        counters.update({"spec_verify_steps": 0, "spec_num_drafts": 0,
                         "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
                         "spec_skipped_grammar": 0, "spec_governor_cut": 0,
                         "spec_graph_cut": 0})

    # -- the governor's hook ---------------------------------------------------------------------

    def budget(self, req: Req) -> int:
        """The most drafts `req` may have this step: the flag's number, none for a constrained
        request the proposer cannot check, and never past max_new_tokens (the last of its
        tokens is always the target's own). The governor asks for this many or fewer."""
        if req.state.matcher is not None and not self.grammars:
            if req.spec_note is None:
                req.spec_note = GRAMMAR_NOTE
                self.counters["spec_skipped_grammar"] += 1
            return 0
        return max(0, min(self.num_draft_tokens, req.remaining_new() - 1))

    # -- one step --------------------------------------------------------------------------------

    def propose(self, batch: list[Req]) -> list[list[int]] | None:
        """Drafts per request of the batch, or None when none has any."""
        caps = [self.budget(r) for r in batch]
        # A seeded sampled request is exempt from the governor's cuts: the drafts it gets
        # decide what its generator draws, and the cuts follow measured step times, so a seed
        # would not repeat its tokens under them.
        seeded = [r.state.generator is not None for r in batch]
        ks = self.governor.budgets([r.rid for r in batch], caps, seeded) if any(caps) else caps
        self.counters["spec_governor_cut"] += sum(c > 0 and k == 0
                                                  for c, k in zip(caps, ks, strict=True))
        ks = self.fit_graphs(ks)
        asks = [(i, r, n) for i, (r, n) in enumerate(zip(batch, ks, strict=True)) if n > 0]
        if not asks:
            return None
        got = self.proposer.propose([DraftRequest(r.rid, r.all_ids, len(r.prompt_ids), n)
                                     for _, r, n in asks])
        if len(got) != len(asks):
            raise RuntimeError(f"speculative proposer gave {len(got)} draft lists for "
                               f"{len(asks)} requests")
        drafts: list[list[int]] = [[] for _ in batch]
        vocab = self.vocab_size
        for (i, r, n), d in zip(asks, got, strict=True):
            d = [int(t) for t in d[:n]]
            if vocab and any(not 0 <= t < vocab for t in d):
                raise RuntimeError(f"speculative proposer drafted a token outside the "
                                   f"vocabulary of {vocab} for request {r.rid}")
            drafts[i] = d
        return drafts if any(drafts) else None

    def fit_graphs(self, ks: list[int]) -> list[int]:
        """Drafts per request cut so the verify step's rows (a request and its drafts each)
        fit the largest captured decode graph, where verify steps replay them (a verify past
        it runs as an eager extend: ~12x a plain step at 320 rows, session 24): the requests'
        drafts are levelled down, the largest first; counted as spec_graph_cut. A batch
        larger than the graphs themselves is left as it is (its decode steps are eager too)."""
        gr = self.runner.graph_runner if getattr(self.runner, "verify_graphs", False) else None
        if gr is None:
            return ks
        room = gr.max_bs - len(ks)
        if room < 0 or sum(ks) <= room:
            return ks
        level = 0  # the highest cap every request's drafts may keep
        while sum(min(k, level + 1) for k in ks) <= room:
            level += 1
        out = [min(k, level) for k in ks]
        spare = room - sum(out)
        for i, k in enumerate(ks):  # what is left, one more draft each, in batch order
            if spare == 0:
                break
            if k > out[i]:
                out[i] += 1
                spare -= 1
        self.counters["spec_graph_cut"] += sum(ks) - sum(out)
        return out

    def pages_needed(self, batch: list[Req], drafts: list[list[int]]) -> int:
        alloc = self.pages.allocator
        return sum(alloc.pages_for(r.kv_len, 1 + len(d)) for r, d in
                   zip(batch, drafts, strict=True))

    def verify(self, batch: list[Req], drafts: list[list[int]]) -> None:
        """One forward over each request's [last token + drafts] (pages already ensured),
        then acceptance, token by token, and the rejected drafts' pages freed."""
        pg = self.pages
        ps = pg.page_size
        alloc = pg.allocator
        rows, prefix, tokens, slots = [], [], [], []
        gslots: list[list[list[int]]] = [[] for _ in pg.windows]
        for r, d in zip(batch, drafts, strict=True):
            n = 1 + len(d)
            pg.add_pages(r, alloc.pages_for(r.kv_len, n))
            rows.append(r.row)
            prefix.append(r.kv_len)
            tokens.append([r.output_ids[-1], *d])
            full, windowed = pg.slots(r, r.kv_len, r.kv_len + n)
            slots.append(full)
            for gs, ws in zip(gslots, windowed, strict=True):
                gs.append(ws)
        lora = None if pg.lora is None else [r.lora_slot for r in batch]
        t0 = time.perf_counter()
        logits = self.runner.verify(rows, prefix, tokens, slots,  # [sum(1 + k), V]
                                    group_slots=gslots, lora=lora)
        starts, at = [], 0
        for t in tokens:
            starts.append(at)
            at += len(t)
        # position j of every request still verifying, in one sampler call per position
        emitted: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in batch]
        live = list(range(len(batch)))
        j = 0
        while live:
            index = torch.tensor([starts[i] + j for i in live], device=logits.device)
            toks, ok, lps = self.sampler.verify(
                logits.index_select(0, index), [batch[i].state for i in live],
                [drafts[i][j] if j < len(drafts[i]) else None for i in live])
            nxt = []
            for i, t, a, lp in zip(live, toks, ok, lps, strict=True):
                emitted[i].append((t, lp))
                if a:
                    nxt.append(i)
            live, j = nxt, j + 1
        self.governor.step_timed(len(logits), time.perf_counter() - t0)  # forward + sampling
        self.counters["spec_verify_steps"] += 1
        self.counters["decode_tokens"] += len(batch)
        for r, d, out in zip(batch, drafts, emitted, strict=True):
            accepted = len(out) - 1
            base = r.kv_len
            keep = base + 1 + accepted  # K/V of the last token and the accepted drafts
            pg.truncate(r, -(-keep // ps))  # pages that held only rejected drafts
            if d:
                self.counters["spec_num_drafts"] += 1
                self.counters["spec_num_draft_tokens"] += len(d)
                self.counters["spec_num_accepted_tokens"] += accepted
                r.spec_drafts += len(d)
                r.spec_accepted += accepted
                r.spec_verify_steps += 1
                self.proposer.observe(r.rid, len(d), accepted)
                self.governor.observe(r.rid, len(d), accepted)
            for e, (t, lp) in enumerate(out):
                r.kv_len = base + 1 + e  # tokens before this one have their K/V
                self.accept(r, t, lp)
                if r.finish is not None:
                    break
            pg.trim(r)  # windowed pages now out of the window (none once it finished)

    def forget(self, req: Req) -> None:
        """req finished, was aborted or retracted: the proposer drops what it kept."""
        self.proposer.reset(req.rid)
        self.governor.forget(req.rid)

    def check_accounting(self, live: set[str]) -> None:
        """The draft model's pool (where there is one): no page leaked or owned twice, and
        none held for a request that is not live."""
        if self.draft is not None:
            self.draft.check_accounting(live)

    def stats(self) -> dict[str, int]:
        return self.draft.stats() if self.draft is not None else {}
