"""Greedy drafts from the engine's draft model: the DraftModelProposer (core.contract.spec)."""

from __future__ import annotations

from collections.abc import Sequence

from core.contract.spec import DraftModel, DraftRequest, SpecConfig


class DraftModelProposer:
    """Per step: bring the draft's cached tokens of each request in line with the request
    (truncate to the common prefix, feed the rest in one batched forward: its greedy next
    token is the first draft), then feed the drafts back one forward at a time until each
    request has its max_tokens. After verification the draft keeps only what was accepted."""

    def __init__(self, config: SpecConfig):
        if config.draft is None or not isinstance(config.draft, DraftModel):
            raise ValueError("the standalone proposer needs the engine's draft model "
                             "(--speculative-draft-model-path): SpecConfig.draft is not set")
        self.config = config
        self.draft: DraftModel = config.draft
        # per request: how many tokens the draft held once caught up at the last propose
        # (its drafts follow them in the cache)
        self.base: dict[str, int] = {}

    def notes(self) -> list[str]:
        return [f"standalone proposer: the draft model drafts up to "
                f"{self.config.num_draft_tokens} tokens greedily per request and step"]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rids, feeds, want = [], [], []
        for i, r in enumerate(requests):
            k = min(r.max_tokens, self.config.num_draft_tokens)
            if k <= 0 or not r.tokens:
                continue
            held = self.draft.cached(r.rid)
            common = _common_prefix(held, r.tokens)
            common = min(common, len(r.tokens) - 1)  # the last token is fed: its logits
            self.draft.truncate(r.rid, common)
            rids.append(r.rid)
            feeds.append(list(r.tokens[common:]))
            want.append((i, k))
            self.base[r.rid] = len(r.tokens)
        while rids:
            got = self.draft.forward(rids, feeds)
            nxt_rids, nxt_feeds, nxt_want = [], [], []
            for rid, t, (i, k) in zip(rids, got, want, strict=True):
                if t is None or (self.config.vocab_size and not
                                 0 <= t < self.config.vocab_size):
                    continue  # the draft's pool could not hold it: no more drafts this step
                drafts[i].append(int(t))
                if len(drafts[i]) < k:
                    nxt_rids.append(rid)
                    nxt_feeds.append([int(t)])
                    nxt_want.append((i, k))
            rids, feeds, want = nxt_rids, nxt_feeds, nxt_want
        return drafts

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        """Roll the draft's K/V back to the accepted drafts (the last draft was never fed)."""
        base = self.base.get(rid)
        if base is not None:
            self.draft.truncate(rid, base + min(accepted, max(drafted - 1, 0)))

    def reset(self, rid: str) -> None:
        self.base.pop(rid, None)
        self.draft.release(rid)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
