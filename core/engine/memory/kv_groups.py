"""The hybrid KV pool's layout: layers grouped by sliding window, and how a byte budget is split.

Why groups: with a window on most layers (Gemma 3: 5 local : 1 global; Gemma 2, GPT-OSS: every
other layer) a long context needs the whole context's K/V only in the full-attention layers; a
windowed layer never reads a key older than its window again. So the pool keeps one *group*
per distinct window (full layers: group 0, window None; then one group per window, ascending),
each with its own K/V buffers (only its layers), its own page allocator and its own page table
(request-to-token rows are shared: a request has the same row in every group's table).

The design, chosen as the simplest that leaves attention backends unchanged:
- A request's page list in a windowed group is positional like the full group's (page i holds
  tokens [i*ps, (i+1)*ps)), but pages that fall wholly out of the window are given back to the
  group's allocator as the request advances (decode, chunked prefill, verify) and replaced, in
  the list and in the group's table, by the group's *dummy page*: a page outside the allocator
  that nothing ever writes, so it holds zeros. Backends see an ordinary table whose old entries
  point at finite values they mask anyway (torch_native masks with -inf before the softmax;
  triton's extend reads whole key blocks from below the window's edge and multiplies their V by
  a zero weight, so a NaN there would leak: zeros cannot).
- Each layer's attention runs on its group's view of the step's ForwardBatch (that group's
  pool, table, new-token slots and backend instance with its own per-step metadata), picked by
  `ForwardBatch.for_layer`; backends are not told groups exist.
- A windowed group's memory per request is bounded by window + one page (the window before
  the last page boundary is kept, so a prefix-cache hit on the request's whole pages can be
  used; exact when the window is a multiple of the page size, one page more otherwise), plus
  the tokens of the extend in flight, whose K/V must all exist during that forward; the full
  group keeps all. Without chunked prefill a prompt's extend is the whole prompt, so windowed
  groups are never sized below one request's peak (worker.plan_hybrid_kv).
- Decode graphs are captured over every group (core.contract.graphs.GraphRunner): each
  group's new slots are a static input, its table is read where it lives, padded rows write
  each group's sink slot 0. --disable-hybrid-kv keeps one pool everywhere.

The split of a budget between groups follows SGLang's SWA pool: windowed groups get
`ratio` x the full group's tokens (--swa-full-tokens-ratio), since a fixed split must choose
between many short requests (ratio near 1) and few long ones (ratio small).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one sliding window (None: full attention) and so one page table."""

    window: int | None
    layers: tuple[int, ...]

    def describe(self) -> str:
        what = "full attention" if self.window is None else f"window {self.window}"
        return f"{what} ({len(self.layers)} layers)"


def kv_groups(sliding_windows: Sequence[int | None], num_layers: int) -> tuple[KVGroup, ...]:
    """Group 0: full-attention layers; then one group per distinct window (ascending).

    A model without windows (or with no window declared) gives one full group. A model whose
    every layer is windowed gives no full group: callers that need one (the hybrid pool) check.
    """
    wins = list(sliding_windows) or [None] * num_layers
    if len(wins) != num_layers:
        raise ValueError(f"{len(wins)} sliding windows for {num_layers} layers")
    groups = []
    full = tuple(i for i, w in enumerate(wins) if w is None)
    if full:
        groups.append(KVGroup(None, full))
    for w in sorted({w for w in wins if w is not None}):
        groups.append(KVGroup(w, tuple(i for i, x in enumerate(wins) if x == w)))
    return tuple(groups)


def hybrid_reason(groups: Sequence[KVGroup], mla: bool) -> str | None:
    """Why the hybrid pool cannot serve this model (None: it can)."""
    if mla:
        return "an MLA latent cache has no windowed layers"
    if len(groups) < 2:
        return "the model has no sliding-window layers" if groups and groups[0].window is None \
            else "every layer shares one sliding window (no full-attention group)"
    return None


def group_tokens(full_tokens: int, ratio: float, page_size: int) -> int:
    """A windowed group's usable tokens for a full group of `full_tokens`: ratio x that,
    in whole pages, never above the full group's (a windowed layer never holds more)."""
    t = int(full_tokens * ratio) // page_size * page_size
    return max(min(t, full_tokens), 2 * page_size)


def split_budget_bytes_per_token(groups: Sequence[KVGroup], layer_bytes: int,
                                 ratio: float) -> float:
    """Bytes one full-group token costs with windowed groups sized at `ratio` x it: what
    sizing divides the KV budget by. layer_bytes: one token's K+V in one layer."""
    full = len(groups[0].layers) * layer_bytes
    return full + sum(ratio * len(g.layers) * layer_bytes for g in groups[1:])
