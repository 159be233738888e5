"""Prompt lookup over a request's prompt and output: the NgramProposer (core.contract.spec)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.contract.spec import DraftRequest, SpecConfig

# Tokens looked back over per request and step: bounds the work of one look-up (a numpy scan
# of at most this many tokens per tried match length) whatever the request's length.
LOOKBACK = 8192


class NgramProposer:
    """For each request, the longest suffix of its tokens (max_match down to min_match tokens)
    that occurred earlier within the look-back window; the drafts are the tokens that followed
    its latest earlier occurrence. Stateless: observe and reset keep nothing."""

    def __init__(self, config: SpecConfig, lookback: int = LOOKBACK):
        if not 1 <= config.min_match <= config.max_match:
            raise ValueError(f"ngram match window: need 1 <= min ({config.min_match}) <= max "
                             f"({config.max_match})")
        self.config = config
        self.lookback = lookback

    def notes(self) -> list[str]:
        c = self.config
        return [f"ngram proposer: suffixes of {c.min_match}..{c.max_match} tokens looked up in "
                f"the last {self.lookback} tokens of each request, up to {c.num_draft_tokens} "
                f"drafts"]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.lookup(r.tokens, min(r.max_tokens, self.config.num_draft_tokens))
                for r in requests]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts for a request whose tokens are `tokens`."""
        lo, hi = self.config.min_match, self.config.max_match
        if k <= 0 or len(tokens) <= lo:
            return []
        arr = np.asarray(tokens[-self.lookback:], dtype=np.int64)
        n = len(arr)
        hi = min(hi, n - 1)
        # a match of the shortest length is needed for any longer one: most requests without
        # a repeat stop after this one comparison
        starts = np.flatnonzero(arr[:n - lo] == arr[n - lo])
        if starts.size == 0:
            return []
        for length in range(hi, lo - 1, -1):
            suffix = arr[n - length:]
            # candidate starts j (j + length <= n - 1: followed by at least one token)
            cand = starts[starts + length <= n - 1] - (length - lo)
            cand = cand[cand >= 0]
            if cand.size == 0:
                continue
            windows = arr[cand[:, None] + np.arange(length)[None, :]]  # [C, length]
            hits = cand[(windows == suffix[None, :]).all(axis=1)]
            if hits.size:
                at = int(hits[-1]) + length
                return arr[at:at + k].tolist()
        return []

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        pass

    def reset(self, rid: str) -> None:
        pass
