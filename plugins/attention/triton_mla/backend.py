"""`triton_mla`'s class: per step, `prepare` picks the decode split count (from the batch size,
the head count and the longest context of the step, read from the host lists; under CUDA graphs
from the longest context a graph may see, fixed per captured batch size); per layer,
`forward_mla` writes the new latent rows into the pool, then runs the absorbed decode or the
materialised extend (the step's requests grouped once, at its first layer: extend.plan_extend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.contract.attention import BackendContext
from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLAAttentionBackend, MLALayerParams, MLAWeights
from plugins.attention.triton_mla.decode import decode_splits, mla_decode, store_latent
from plugins.attention.triton_mla.extend import (
    ExtendGroup,
    chunk_tokens,
    extend_batch,
    extend_config,
    plan_extend,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TritonMLAMeta:
    """Per-step metadata shared by every layer of the step."""

    decode: bool
    num_splits: int  # decode: KV splits per (request, head block)
    # extend: the requests grouped (plan_extend), by the step's first layer (the chunk size
    # depends on the layer's head dims)
    groups: list[ExtendGroup] | None = None


class TritonMLA(MLAAttentionBackend):
    """MLA in Triton: absorbed split-KV decode over the latent pool, materialised extend with
    the latent expanded a chunk of tokens at a time; fp32/fp16/bf16 compute and latent cache."""

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        if ctx.dtype not in _DTYPES:
            raise ValueError(f"triton_mla computes in float32, float16 or bfloat16, not "
                             f"{ctx.dtype}")
        if ctx.kv_dtype not in _DTYPES:
            raise ValueError(f"triton_mla stores the latent cache in float32, float16 or "
                             f"bfloat16, not {ctx.kv_dtype} (no FP8 latent cache yet: its "
                             f"kernels read the rows unscaled)")
        self._graph_context: int | None = None

    def _decode_meta(self, batch_size: int, context: int | None,
                     device: torch.device) -> TritonMLAMeta:
        return TritonMLAMeta(True, decode_splits(batch_size, self.ctx.num_heads, device,
                                                 context))

    def prepare(self, batch: ForwardBatch) -> TritonMLAMeta:
        if batch.is_decode:
            return self._decode_meta(batch.batch_size, max(batch.seq_lens_cpu, default=1),
                                     batch.seq_lens.device)
        return TritonMLAMeta(False, 0)

    def init_graph_state(self, max_bs: int, max_context: int) -> None:
        # A graph replays for any context up to max_context: its split count is chosen for that
        # longest one (shorter requests use fewer of the splits at run time).
        self._graph_context = max_context

    def prepare_for_graph(self, batch: ForwardBatch, bs: int) -> TritonMLAMeta:
        if not batch.is_decode or batch.batch_size != bs:
            raise ValueError(f"triton_mla captures decode batches only (got "
                             f"{batch.mode.value}, {batch.batch_size} rows for a graph of {bs})")
        context = self._graph_context or self.ctx.max_context_len or None
        return self._decode_meta(bs, context, batch.seq_lens.device)

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, weights: MLAWeights, layer: MLALayerParams,
                    batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        buf = pool.get_latent_buffer(layer.layer_id)
        if latent.stride(-1) == 1 and k_rope.stride(-1) == 1 and buf.stride(-1) == 1:
            store_latent(buf, batch.out_cache_loc, latent, k_rope)  # both parts, one kernel
        else:
            pool.set_latent(layer.layer_id, batch.out_cache_loc, latent, k_rope)
        if not isinstance(batch.attn_meta, TritonMLAMeta):
            batch.attn_meta = self.prepare(batch)
        meta = batch.attn_meta
        T, H = q_nope.shape[:2]
        Dv = layer.v_head_dim
        if meta.decode:
            out = mla_decode(q_nope, q_rope, buf, weights, layer, batch.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, meta.num_splits)
            return out.reshape(T, H * Dv)
        out = torch.empty(T, H, Dv, dtype=q_nope.dtype, device=q_nope.device)
        if meta.groups is None:
            cfg = extend_config(q_nope.dtype)
            chunk = chunk_tokens(H, layer.qk_nope_head_dim, Dv, cfg)
            meta.groups = plan_extend(batch.req_to_token, batch.req_pool_indices,
                                      batch.seq_lens_cpu, batch.extend_lens_cpu, chunk,
                                      cfg.block_m)
        extend_batch(q_nope, q_rope, meta.groups, buf, weights, layer, out)
        return out.view(T, H * Dv)
