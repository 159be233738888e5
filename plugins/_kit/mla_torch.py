"""The two forms of MLA (core.contract.mla) in PyTorch: the materialised one (latent expanded
through kv_b_proj into per-head K and V) and the absorbed one (q_nope through w_kc into the latent
space, attention over the latent, out through w_vc); and `TorchMLA`, a backend running them one
request at a time: torch_native_mla's class, and the base of the MLA backends that replace only
its decode (cpu_c_mla)."""

from __future__ import annotations

import torch

from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLAAttentionBackend, MLALayerParams, MLAWeights


def _causal_mask(n_new: int, n_all: int, device: torch.device) -> torch.Tensor:
    """[n_new, n_all] True where query j (at position n_all - n_new + j) sees key s."""
    q_pos = torch.arange(n_all - n_new, n_all, device=device)[:, None]
    return torch.arange(n_all, device=device)[None, :] <= q_pos


def mla_materialised(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                     weights: MLAWeights, layer: MLALayerParams) -> torch.Tensor:
    """q_nope [n, H, Dn], q_rope [n, H, Dr] of the last n of the S cached tokens, cache
    [S, R + Dr] -> [n, H, Dv], in fp32: K and V expanded per head from the latent."""
    R = layer.kv_lora_rank
    c, kr = cache[:, :R].float(), cache[:, R:].float()  # [S, R], [S, Dr]
    k_nope = torch.einsum("sr,hdr->hsd", c, weights.w_kc.float())  # [H, S, Dn]
    v = torch.einsum("sr,hdr->hsd", c, weights.w_vc.float())  # [H, S, Dv]
    scores = (torch.einsum("nhd,hsd->hns", q_nope.float(), k_nope)
              + torch.einsum("nhd,sd->hns", q_rope.float(), kr)) * layer.scaling  # [H, n, S]
    mask = _causal_mask(q_nope.shape[0], cache.shape[0], cache.device)
    p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hns,hsd->nhd", p, v)


def mla_absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                 weights: MLAWeights, layer: MLALayerParams) -> torch.Tensor:
    """The same function as mla_materialised, computed over the latent: nothing per head is
    expanded from the S cached tokens."""
    R = layer.kv_lora_rank
    c, kr = cache[:, :R].float(), cache[:, R:].float()
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), weights.w_kc.float())  # [n, H, R]
    scores = (torch.einsum("nhr,sr->hns", q_lat, c)
              + torch.einsum("nhd,sd->hns", q_rope.float(), kr)) * layer.scaling
    mask = _causal_mask(q_nope.shape[0], cache.shape[0], cache.device)
    p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    o_lat = torch.einsum("hns,sr->nhr", p, c)  # [n, H, R]
    return torch.einsum("nhr,hdr->nhd", o_lat, weights.w_vc.float())


class TorchMLA(MLAAttentionBackend):
    """The MLA reference: one request at a time; extend steps materialise K/V (their queries
    share the expansion), decode steps run absorbed (the latent read once, never expanded).
    A subclass may replace the whole decode step (`decode`)."""

    def decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
               weights: MLAWeights, layer: MLALayerParams, batch: ForwardBatch
               ) -> torch.Tensor | None:
        """A decode step's [B, H, Dv] over the layer's latent buffer (its rows already
        written), or None to run the per-request absorbed loop."""
        return None

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, weights: MLAWeights, layer: MLALayerParams,
                    batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        pool.set_latent(layer.layer_id, batch.out_cache_loc, latent, k_rope)
        buf = pool.get_latent_buffer(layer.layer_id)
        T, H = q_nope.shape[:2]
        if batch.is_decode:
            out = self.decode(q_nope, q_rope, buf, weights, layer, batch)
            if out is not None:
                return out.to(q_nope.dtype).reshape(T, H * layer.v_head_dim)
        attend = mla_absorbed if batch.is_decode else mla_materialised
        out = torch.empty(T, H, layer.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        start = 0
        for i, (seq, new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu,
                                           strict=True)):
            slots = batch.req_to_token[batch.req_pool_indices[i], :seq].long()
            rows = slice(start, start + new)
            out[rows] = attend(q_nope[rows], q_rope[rows], buf[slots], weights, layer).to(
                out.dtype)
            start += new
        return out.view(T, H * layer.v_head_dim)
