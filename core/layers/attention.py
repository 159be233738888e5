"""The attention layer: holds its static parameters and delegates to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from core.contract.attention import AttentionLayerParams
from core.contract.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; the backend is whatever `batch.attn_backend` is."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float | None = None, sliding_window: int | None = None,
                 logit_softcap: float | None = None, v_head_dim: int | None = None,
                 sinks: torch.Tensor | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.params = AttentionLayerParams(
            layer_id=layer_id, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, scaling=head_dim ** -0.5 if scaling is None else scaling,
            sliding_window=sliding_window, logit_softcap=logit_softcap, v_head_dim=v_head_dim,
            sinks=sinks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*Dv]; the backend writes k/v into the pool."""
        batch = batch.for_layer(self.params.layer_id)  # its KV group's view (hybrid pool)
        return batch.attn_backend.forward(q, k, v, self.params, batch)

    def extra_repr(self) -> str:
        p = self.params
        return (f"layer={p.layer_id}, heads={p.num_heads}, kv_heads={p.num_kv_heads}, "
                f"head_dim={p.head_dim}, window={p.sliding_window}, softcap={p.logit_softcap}")
