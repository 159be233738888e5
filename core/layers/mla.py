"""The MLA attention layer (core.contract.mla): holds kv_b_proj's weight and the layer's static
parameters, and delegates to the step's MLA backend."""

from __future__ import annotations

import torch
from torch import nn

from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLAAttentionBackend, MLALayerParams, MLAWeights


class MLAAttention(nn.Module):
    """Multi-head latent attention over the latent cache.

    `kv_b_proj.weight` [H * (Dn + Dv), R] (the checkpoint's name under this module) is kept
    dense and in the checkpoint's layout: the backend uses its two halves (MLAWeights) to
    expand the latent or to absorb it, so no quant method or platform repacks it.
    """

    def __init__(self, params: MLALayerParams, dtype: torch.dtype,
                 device: torch.device | None = None):
        super().__init__()
        self.params = params
        rows = params.num_heads * (params.qk_nope_head_dim + params.v_head_dim)
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(
            torch.empty(rows, params.kv_lora_rank, dtype=dtype, device=device),
            requires_grad=False)
        self._weights: MLAWeights | None = None

    def reset_bindings(self) -> None:
        self._weights = None  # the weight may have been replaced (loading)

    def weights(self) -> MLAWeights:
        if self._weights is None:
            self._weights = MLAWeights.split(self.kv_b_proj.weight, self.params.num_heads,
                                             self.params.qk_nope_head_dim)
        return self._weights

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                k_rope: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, Dn], q_rope [T, H, Dr] (rotated), latent [T, R] (normed), k_rope
        [T, Dr] (rotated) -> [T, H * Dv]; the backend writes the latent rows into the pool."""
        backend = batch.attn_backend
        if not isinstance(backend, MLAAttentionBackend):
            raise TypeError(f"an MLA model needs an MLA attention backend, not "
                            f"{type(backend).__name__}")
        return backend.forward_mla(q_nope, q_rope, latent, k_rope, self.weights(), self.params,
                                   batch)
