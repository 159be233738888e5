"""SuffixProposer (core.contract.spec): continuation counts of every context of 1..depth tokens.

A suffix tree of depth D over a token sequence answers "after this context of up to D tokens,
which tokens came next, and how often"; the same answers come from a table keyed by each
context (a tuple of 1..D tokens) holding its next tokens' counts, which is what `Index` keeps
(D entries per token indexed; a token is indexed once, when it is first seen). Two indexes are
asked: the request's own (its prompt and output so far, built as it grows) and a shared one
over the outputs of earlier requests (added when a request is reset, that is finished, aborted
or retracted; the oldest dropped past `cache_tokens`). A draft is built a token at a time: the
longest context (up to D) ending in the tokens so far, drafts included, that either index
knows picks the next token, the most frequent after it (ties: the most recently seen); the
request's own index wins a tie of lengths. The chain stops when no context of at least
`min_match` tokens is known, or when the product of the picked tokens' frequencies (each
count / the context's total) falls below `min_prob`: a draft the history disagrees about is
cut short rather than wasted on the verifier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from core.contract.spec import DraftRequest, SpecConfig

CACHE_TOKENS = 65_536  # earlier outputs kept in the shared index (the oldest go first)
MIN_PROB = 0.1  # a chain stops once its estimated probability falls below this
LOOKBACK = 8192  # a request's own index covers at most its last this many tokens


class Index:
    """Next-token counts of every context of 1..depth tokens of the sequences added."""

    def __init__(self, depth: int):
        self.depth = depth
        # context tuple -> [best next token, total count, {next token: [count, stamp]}]; the
        # best is kept up to date as tokens are added (a look-up is then one dict access)
        self.table: dict[tuple[int, ...], list] = {}
        self.stamp = 0

    def add(self, tokens: Sequence[int], start: int = 1, sign: int = 1) -> None:
        """Count each token of tokens[start:] after its contexts (sign -1 takes them out)."""
        table, depth = self.table, self.depth
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            self.stamp += 1
            for d in range(1, min(depth, i) + 1):
                ctx = tuple(tokens[i - d:i])
                node = table.get(ctx)
                if sign > 0:
                    if node is None:
                        node = table[ctx] = [nxt, 0, {}]
                    node[1] += 1
                    entry = node[2].get(nxt)
                    if entry is None:
                        entry = node[2][nxt] = [0, 0]
                    entry[0] += 1
                    entry[1] = self.stamp
                    if nxt != node[0] and entry[0] >= node[2][node[0]][0]:
                        node[0] = nxt  # as frequent and more recent
                elif node is not None and nxt in node[2]:
                    entry = node[2][nxt]
                    entry[0] -= 1
                    node[1] -= 1
                    if entry[0] <= 0:
                        del node[2][nxt]
                    if not node[2]:
                        del table[ctx]
                    elif nxt == node[0]:  # the best may have changed: find it again
                        node[0] = max(node[2].items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]

    def longest(self, tokens: Sequence[int], lo: int) -> tuple[int, list | None]:
        """(length, [best, total, counts]) of the longest context ending `tokens` (at least lo
        tokens long) this index has seen; (0, None) when none."""
        for d in range(min(self.depth, len(tokens)), lo - 1, -1):
            node = self.table.get(tuple(tokens[len(tokens) - d:]))
            if node is not None:
                return d, node
        return 0, None


class _Own:
    """A request's own index and how far its tokens are indexed."""

    def __init__(self, depth: int):
        self.index = Index(depth)
        self.done = 0  # tokens[:done] are counted
        self.base = 0  # the first token counted (a sliding window over long requests)


class SuffixProposer:
    def __init__(self, config: SpecConfig, cache_tokens: int = CACHE_TOKENS,
                 min_prob: float = MIN_PROB, lookback: int = LOOKBACK):
        if not 1 <= config.min_match <= config.max_match:
            raise ValueError(f"suffix match window: need 1 <= min ({config.min_match}) <= max "
                             f"({config.max_match})")
        if cache_tokens < 0 or not 0.0 <= min_prob <= 1.0:
            raise ValueError("suffix: cache_tokens must be >= 0 and min_prob in [0, 1]")
        self.config, self.cache_tokens, self.min_prob = config, cache_tokens, min_prob
        self.lookback = lookback
        self.shared = Index(config.max_match)
        # rid -> (tokens kept, index of the first one counted: the output's)
        self.cached: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        self.cached_tokens = 0
        self.own: dict[str, _Own] = {}
        # rid -> (its tokens as last proposed for, prompt length): what reset() caches
        self.last: dict[str, tuple[Sequence[int], int]] = {}

    def notes(self) -> list[str]:
        c = self.config
        return [f"suffix proposer: contexts of {c.min_match}..{c.max_match} tokens matched in "
                f"the request (last {self.lookback} tokens) and in the outputs of earlier "
                f"requests (up to {self.cache_tokens} tokens kept); up to "
                f"{c.num_draft_tokens} drafts, cut where their estimated probability falls "
                f"below {self.min_prob}"]

    # ---- the protocol ----
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            k = min(r.max_tokens, self.config.num_draft_tokens)
            toks = r.tokens
            self.last[r.rid] = (toks, r.prompt_len)
            own = self._own(r.rid, toks)
            out.append(self._draft(own.index, toks, k) if k > 0 and toks else [])
        return out

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        pass  # the accepted tokens come back in the next propose's tokens

    def reset(self, rid: str) -> None:
        self.own.pop(rid, None)
        seen = self.last.pop(rid, None)
        if seen is None or self.cache_tokens == 0:
            return
        toks, prompt_len = seen
        if len(toks) <= prompt_len:
            return
        # the output, after the prompt's last tokens (the contexts of its first tokens)
        keep = list(toks[max(0, prompt_len - self.config.max_match, len(toks) - self.cache_tokens):])
        first = max(1, len(keep) - (len(toks) - prompt_len))
        old = self.cached.pop(rid, None)  # a retracted request comes back and ends later
        if old is not None:
            self.shared.add(old[0], start=old[1], sign=-1)
            self.cached_tokens -= len(old[0])
        self.cached[rid] = (keep, first)
        self.cached_tokens += len(keep)
        self.shared.add(keep, start=first)
        while self.cached_tokens > self.cache_tokens:
            _, (gone, at) = self.cached.popitem(last=False)
            self.shared.add(gone, start=at, sign=-1)
            self.cached_tokens -= len(gone)

    # ---- internals ----
    def _own(self, rid: str, toks: Sequence[int]) -> _Own:
        """rid's own index with every token of `toks` counted (only the new ones indexed now);
        past 2 x lookback tokens it is rebuilt over the last `lookback`, bounding its size."""
        own = self.own.get(rid)
        if own is None or len(toks) < own.done:  # new, or its tokens went back
            own = self.own[rid] = _Own(self.config.max_match)
        if len(toks) - own.base > 2 * self.lookback:
            own = self.own[rid] = _Own(self.config.max_match)
            own.base = own.done = len(toks) - self.lookback
        own.index.add(toks, start=max(own.done, own.base + 1))
        own.done = len(toks)
        return own

    def _draft(self, own: Index, toks: Sequence[int], k: int) -> list[int]:
        lo, vocab = self.config.min_match, self.config.vocab_size
        ctx = list(toks[-self.config.max_match:])
        drafts: list[int] = []
        prob = 1.0
        while len(drafts) < k:
            d_own, n_own = own.longest(ctx, lo)
            d_sh, n_sh = self.shared.longest(ctx, lo)
            node = n_own if d_own >= d_sh else n_sh
            if node is None:
                break
            tok = node[0]
            prob *= node[2][tok][0] / node[1]
            if prob < self.min_prob or (vocab and not 0 <= tok < vocab):
                break
            drafts.append(tok)
            ctx = (ctx + [tok])[-self.config.max_match:]
        return drafts
