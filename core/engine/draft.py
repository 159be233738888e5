"""The draft model of speculative decoding (core.contract.spec.DraftModel): a second model run
by the engine with a paged KV pool, request table and page allocator of its own, next to the
target's and never shared with it (no prefix cache: a request's draft K/V lives while the
proposer keeps it and goes back on truncate / release).

Each request id holds a row of the draft's request table, the pages of its cached tokens and
the token ids themselves. `forward` extends every request of a batch by the tokens given (one
extend forward, or one decode forward when each gets one token; a long catch-up, such as a new
request's prompt, in chunks of at most `max_extend` tokens) and gives the greedy next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.engine.memory.memory_pool import PageAllocator, ReqToTokenPool, token_slots

if TYPE_CHECKING:
    from core.engine.model_runner import ModelRunner


@dataclass
class _Held:
    row: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftModelRunner:
    """The engine's draft model for a draft-model proposer (see the module doc)."""

    def __init__(self, runner: ModelRunner, allocator: PageAllocator,
                 req_to_token: ReqToTokenPool, vocab_size: int, max_extend: int = 512):
        """vocab_size: drafts lie below it (the smaller of the two models' vocabularies);
        max_extend: most tokens of one request per forward (a long catch-up is chunked)."""
        self.runner, self.allocator, self.req_to_token = runner, allocator, req_to_token
        self.page_size = allocator.page_size
        self.vocab_size = vocab_size
        self.max_extend = max(1, max_extend)
        self.held: dict[str, _Held] = {}
        self.dropped = 0  # requests whose K/V was dropped for want of pages or rows

    # -- the contract (core.contract.spec.DraftModel) ---------------------------------------------

    def cached(self, rid: str) -> Sequence[int]:
        h = self.held.get(rid)
        return tuple(h.tokens) if h is not None else ()

    def truncate(self, rid: str, n: int) -> None:
        h = self.held.get(rid)
        if h is None or n >= len(h.tokens):
            return
        n = max(n, 0)
        keep = -(-n // self.page_size)
        self.allocator.free(h.pages[keep:])
        del h.pages[keep:], h.tokens[n:]

    def release(self, rid: str) -> None:
        h = self.held.pop(rid, None)
        if h is not None:
            self.allocator.free(h.pages)
            self.req_to_token.free(h.row)

    def forward(self, rids: Sequence[str], tokens: Sequence[Sequence[int]]
                ) -> list[int | None]:
        if len(rids) != len(tokens) or len(set(rids)) != len(rids):
            raise ValueError("draft forward: one token list per distinct request id")
        if any(not t for t in tokens):
            raise ValueError("draft forward: every request needs at least one new token")
        out: list[int | None] = [None] * len(rids)
        live = [i for i, (rid, t) in enumerate(zip(rids, tokens, strict=True))
                if self._room(rid, len(t))]
        todo = {i: list(tokens[i]) for i in live}
        while todo:
            step = {i: t[:self.max_extend] for i, t in todo.items()}
            last = [i for i, t in todo.items() if len(t) <= self.max_extend]
            logits = self._forward([rids[i] for i in step], list(step.values()),
                                   [list(step).index(i) for i in last])
            if last:
                nxt = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
                for i, t in zip(last, nxt, strict=True):
                    out[i] = int(t)
            todo = {i: t[self.max_extend:] for i, t in todo.items()
                    if len(t) > self.max_extend}
        return out

    # -- the engine's side -----------------------------------------------------------------------

    def _room(self, rid: str, n: int) -> bool:
        """Pages (and a row) for n more tokens of rid, taken now; False (rid's K/V dropped)
        when the pool cannot hold them."""
        h = self.held.get(rid)
        if h is None:
            if not self.req_to_token.free_rows:
                self.dropped += 1
                return False
            h = self.held[rid] = _Held(self.req_to_token.alloc())
        need = self.allocator.pages_for(len(h.tokens), n)
        if len(h.tokens) + n > self.req_to_token.max_context or \
                need > self.allocator.free_pages:
            self.release(rid)
            self.dropped += 1
            return False
        h.pages += self.allocator.alloc(need)
        return True

    def _forward(self, rids: list[str], tokens: list[list[int]], logits_for: list[int]
                 ) -> torch.Tensor | None:
        """One forward appending tokens[i] to rids[i] (pages already held) -> logits at the
        last token of each request in logits_for [len(logits_for), V]."""
        held = [self.held[r] for r in rids]
        rows = [h.row for h in held]
        starts = [len(h.tokens) for h in held]
        slots = [token_slots(h.pages, s, s + len(t), self.page_size)
                 for h, s, t in zip(held, starts, tokens, strict=True)]
        if all(len(t) == 1 for t in tokens) and len(logits_for) == len(rids):
            logits = self.runner.decode(rows, [t[0] for t in tokens], starts,
                                        [s[0] for s in slots])
        else:
            logits = self.runner.extend(rows, starts, tokens, slots, logits_for)
        for h, t in zip(held, tokens, strict=True):
            h.tokens += t
        return logits

    def check_accounting(self, live: set[str] | None = None) -> None:
        """Assert the draft pool's pages are free or held by exactly one request, and (given
        the scheduler's live request ids) that no finished request still holds any."""
        in_use = [p for h in self.held.values() for p in h.pages]
        self.allocator.check_accounting((), in_use)
        for rid, h in self.held.items():
            want = -(-len(h.tokens) // self.page_size)
            assert len(h.pages) == want, (f"draft KV of {rid}: {len(h.pages)} pages for "
                                          f"{len(h.tokens)} tokens")
        if live is not None:
            stale = sorted(set(self.held) - live)
            assert not stale, f"draft KV still held for finished requests {stale[:5]}"
        rows = [h.row for h in self.held.values()]
        assert len(set(rows)) == len(rows), "a draft request row is held twice"
        assert self.req_to_token.free_rows + len(rows) == self.req_to_token.max_reqs, \
            "draft request rows leaked"

    def stats(self) -> dict[str, int]:
        return {"spec_draft_free_pages": self.allocator.free_pages,
                "spec_draft_total_pages": self.allocator.total_pages,
                "spec_draft_requests": len(self.held),
                "spec_draft_dropped": self.dropped,
                "spec_draft_forwards": sum(self.runner.forward_count.values())}
