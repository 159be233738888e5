"""Per-step batch state passed explicitly from the model runner to the model and its backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from core.contract.attention import AttentionBackend  # it imports this module
    from core.engine.memory.kv_cache import KVPool, MLAKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly over a cached prefix (prefix_lens > 0), possibly chunked
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """One forward step over a ragged batch of requests, in SGLang's terms.

    Token slots: a KV slot index is page * page_size + offset into the per-layer K/V buffers.
    `req_to_token[req_pool_indices[i], :seq_lens[i]]` are the slots of request i's tokens.

    Shapes (B = batch size, T = total new tokens this step = sum(extend_lens) or B for decode):
      input_ids     [T] int64
      positions     [T] int64
      seq_lens      [B] int32   total tokens of each request after this step (prefix + new)
      prefix_lens   [B] int32   tokens already in the cache before this step (extend only)
      extend_lens   [B] int32   new tokens of each request this step (1 in decode)
      out_cache_loc [T] int64   slot where each new token's K/V is written
      req_pool_indices [B] int64 row of each request in req_to_token
    `*_cpu` lists mirror the small per-request vectors on the host so that backends need not sync.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32 (the pool's table)
    kv_pool: KVPool | MLAKVPool  # MLAKVPool for MLA models (core.contract.mla)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    attn_backend: AttentionBackend | None = None  # the one chosen for this step's phase
    # prepared once per step by that backend, of its own type (opaque to others)
    attn_meta: Any = None
    # A hybrid KV pool (core.engine.memory.kv_groups): this step's batch per KV group (each
    # with its group's pool, table, out_cache_loc, backend and metadata; [0] is this batch)
    # and each layer's group. None: one pool, every layer uses this batch.
    groups: tuple[ForwardBatch, ...] | None = None
    layer_group: tuple[int, ...] | None = None

    def for_layer(self, layer_id: int) -> ForwardBatch:
        """The batch layer `layer_id`'s attention runs on: its KV group's view (this batch when
        the pool has one group). Backends only ever see such a view."""
        if self.layer_group is None:
            return self
        return self.groups[self.layer_group[layer_id]]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE
