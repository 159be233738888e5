"""The attention-backend protocol the engine calls, and the per-layer parameters it passes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from core.contract.forward_batch import ForwardBatch


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
    # Attention sinks (GPT-OSS): a learned logit per query head [num_heads] (fp32, this rank's
    # heads) that joins each row's softmax denominator and carries no value:
    # out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)). None: no sinks. Only a backend
    # whose AttentionCaps declare sinks is given one (the resolver sees to it).
    sinks: torch.Tensor | None = field(default=None, compare=False)


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

    # Optional graph hooks (core.engine.graphs). A backend whose caps declare cuda_graph=True promises
    # that its decode forward, given the metadata of prepare_for_graph, reads every per-step value
    # (seq_lens, table, slots) from the batch's device tensors and never syncs with the host, so a
    # graph captured once per batch size replays for any context length. Graph safety is declared
    # there only (AttentionCaps.cuda_graph), not on the class.

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    def prepare(self, batch: ForwardBatch) -> object:  # noqa: B027 - optional hook
        """Per-step metadata computed once for all layers (e.g. index tensors)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, num_heads*head_dim], k/v: [T, num_kv_heads*head_dim] -> [T, num_heads*v_dim]."""

    def init_graph_state(self, max_bs: int, max_context: int) -> None:  # noqa: B027 - optional
        """Allocate whatever static buffers decode graphs of up to `max_bs` rows need (called
        once, before any capture)."""

    def prepare_for_graph(self, batch: ForwardBatch, bs: int) -> object:
        """Metadata for a decode batch of `bs` rows whose tensors are the graph's static buffers.

        Called once per captured batch size; every replay reuses the returned object, so it may
        depend on `bs` but not on the values in the batch's tensors. Over a hybrid KV pool each
        group's view has its own backend instance, so this is called on each with its view.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")
