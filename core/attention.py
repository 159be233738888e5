"""The attention-backend protocol the engine calls, and the per-layer parameters it passes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from core.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerParams:
    """Static per-layer attention parameters (set by the model, read by backends)."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # tokens visible including the current one; None = all
    logit_softcap: float | None = None
    v_head_dim: int | None = None  # defaults to head_dim


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory is given: the model geometry and where it runs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype  # compute dtype
    kv_dtype: torch.dtype  # storage dtype of the KV cache
    device: torch.device
    page_size: int
    max_context_len: int


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache.

    Per step the runner calls `prepare(batch)` once (before the model runs); the returned metadata
    is stored in `batch.attn_meta`. Each attention layer then calls `forward`, which writes the new
    tokens' K/V into the pool at `batch.out_cache_loc` and returns the attention output.
    """

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    def prepare(self, batch: ForwardBatch) -> Any:  # noqa: B027 - optional hook
        """Per-step metadata computed once for all layers (e.g. index tensors)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, num_heads*head_dim], k/v: [T, num_kv_heads*head_dim] -> [T, num_heads*v_dim]."""
