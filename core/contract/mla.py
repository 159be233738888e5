"""The MLA attention kind: what a backend declaring "MLA" (AttentionCaps.attention_kinds) is
given per layer, and what it returns. Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

Per token the model computes, for H heads (Dn = qk_nope_head_dim, Dr = qk_rope_head_dim,
Dv = v_head_dim, R = kv_lora_rank):
- q_nope [T, H, Dn] and q_rope [T, H, Dr]: the query's two parts, q_rope already rotated;
- latent [T, R]: kv_a_proj's compressed KV, after kv_a_layernorm (no rope);
- k_rope [T, Dr]: the key's rope part, one for all heads, already rotated.
The pool (core.engine.memory.kv_cache.MLAKVPool) keeps one row of R + Dr values per token and
layer: [latent | k_rope]. Nothing per head is cached.

kv_b_proj's weight [H * (Dn + Dv), R] in its two halves (MLAWeights): w_kc [H, Dn, R] (k_nope =
w_kc @ latent) and w_vc [H, Dv, R] (v = w_vc @ latent). The backend may compute either form:
- materialised: k = [w_kc @ c | k_rope], v = w_vc @ c per head and cached token, then softmax
  attention of [q_nope | q_rope] over them (what prefill does: T query rows share the expansion);
- absorbed: q_lat = q_nope @ w_kc [T, H, R]; score(t, s) = (q_lat . c_s + q_rope . kr_s) *
  scaling; o_lat = softmax @ c [T, H, R]; out = o_lat @ w_vc^T [T, H, Dv] (what decode does: the
  latent is read once for all heads, never expanded).
Both are the same function; `scaling` is the softmax scale with YaRN's mscale folded in.

`MLAAttentionBackend.forward_mla(...)` writes every new token's row at batch.out_cache_loc, then
attends each new token over its request's cached rows (req_to_token; causal within the new
tokens, prefix tokens all visible) and returns [T, H * Dv] in q's dtype. It may assume: the caps
it declared were checked (page size, latent width R + Dr in `head_sizes`, cache dtype); the
weights are contiguous in the compute dtype and not modified during the call.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from core.contract.attention import AttentionBackend, AttentionLayerParams
from core.contract.forward_batch import ForwardBatch


@dataclass(frozen=True)
class MLALayerParams:
    """Static per-layer MLA parameters (set by the model, read by backends)."""

    layer_id: int
    num_heads: int  # this rank's heads (all of them without tensor parallelism)
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # Dr
    v_head_dim: int  # Dv
    scaling: float  # softmax scale: (Dn + Dr) ** -0.5, times YaRN's mscale ** 2 where it applies

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: R + Dr (576 for DeepSeek-V2/V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLAWeights:
    """kv_b_proj's two halves, per head: w_kc [H, Dn, R] and w_vc [H, Dv, R] (views of the
    checkpoint's [H * (Dn + Dv), R] weight, in the compute dtype)."""

    w_kc: torch.Tensor
    w_vc: torch.Tensor

    @classmethod
    def split(cls, kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int
              ) -> MLAWeights:
        """From kv_b_proj's weight [H * (Dn + Dv), R] (HF's layout: per head, Dn rows of k_nope
        then Dv rows of v)."""
        w = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])  # [H, Dn + Dv, R]
        return cls(w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:])


class MLAAttentionBackend(AttentionBackend):
    """An attention backend for the MLA kind (see the module doc). `prepare` as for any backend;
    `forward` (the per-head K/V form) is not part of this kind."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} is an MLA backend: models call forward_mla")

    @abstractmethod
    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, weights: MLAWeights, layer: MLALayerParams,
                    batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, Dn], q_rope [T, H, Dr], latent [T, R], k_rope [T, Dr] -> [T, H * Dv];
        writes [latent | k_rope] of the T new tokens into the pool first."""
