"""`triton` attention: Triton kernels over the paged KV cache (CUDA sm80+, ROCm untested).

Imported only when the backend is chosen (it imports triton). Per step, `prepare` builds the
little the kernels need beyond the batch itself: the KV split count for decode (from the batch
size, the SM count and the longest context of the step, read from the host lists; under CUDA
graphs from the longest context a graph may see, fixed per captured batch size) and, for extend,
the query offsets of each request and the longest extension. Per
layer, `forward` writes the new K/V into the pool, then runs the decode or extend kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.contract.attention import AttentionBackend, AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins.attention.triton import CAPS
from plugins.attention.triton.common import cuda_capability
from plugins.attention.triton.decode import decode_attention, decode_splits
from plugins.attention.triton.extend import extend_attention

_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_KV_DTYPES = _DTYPES | {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class TritonMeta:
    """Per-step metadata shared by every layer of the step."""

    decode: bool
    num_splits: int  # decode: KV splits per (request, KV head)
    q_starts: torch.Tensor | None  # extend: [B] int32 first row of each request in q
    max_extend_len: int  # extend: longest new-token run (sizes the grid)


class TritonAttention(AttentionBackend):
    """Paged attention in Triton: split-KV decode, prefix+causal extend, GQA/MQA, sliding window,
    logit soft-cap, fp16/bf16/fp32 compute, FP8 (e4m3/e5m2) KV cache with per-tensor scales."""

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        if ctx.dtype not in _DTYPES:
            raise ValueError(f"triton attention computes in float16, bfloat16 or float32, "
                             f"not {ctx.dtype}")
        if ctx.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"triton attention cannot read a {ctx.kv_dtype} KV cache")
        if CAPS.head_sizes is not None and ctx.head_dim not in CAPS.head_sizes:
            raise ValueError(f"triton attention supports head sizes "
                             f"{sorted(CAPS.head_sizes)}, not {ctx.head_dim}")
        if (ctx.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                and ctx.device.type == "cuda" and torch.version.hip is None
                and cuda_capability(ctx.device) < 89):
            # Triton (3.6) converts FP8 with cvt.e4m3x2/e5m2x2, which ptxas accepts from sm89.
            raise ValueError("triton attention reads an FP8 KV cache on sm89+ only (device is "
                             f"sm{cuda_capability(ctx.device)})")
        if ctx.num_heads % ctx.num_kv_heads:
            raise ValueError(f"num_heads {ctx.num_heads} is not a multiple of num_kv_heads "
                             f"{ctx.num_kv_heads}")

    def _decode_meta(self, batch_size: int, context: int | None,
                     device: torch.device) -> TritonMeta:
        c = self.ctx
        splits = decode_splits(batch_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim,
                               c.dtype, device, context=context)
        return TritonMeta(True, splits, None, 0)

    def prepare(self, batch: ForwardBatch) -> TritonMeta:
        if batch.is_decode:
            return self._decode_meta(batch.batch_size, max(batch.seq_lens_cpu, default=1),
                                     batch.seq_lens.device)
        ext = batch.extend_lens
        # Exclusive prefix sum on the device: no copy of the host lists, no sync.
        q_starts = (torch.cumsum(ext, 0, dtype=torch.int32) - ext).to(torch.int32)
        return TritonMeta(False, 0, q_starts, max(batch.extend_lens_cpu, default=0))

    # Decode grids depend on the batch size and the split count only, and seq lens stay on
    # the device (CAPS).
    _graph_context: int | None = None

    def init_graph_state(self, max_bs: int, max_context: int) -> None:
        # A graph replays for any context up to max_context: its split count is chosen for that
        # longest one (shorter requests use fewer of the splits at run time).
        self._graph_context = max_context

    def prepare_for_graph(self, batch: ForwardBatch, bs: int) -> TritonMeta:
        if not batch.is_decode or batch.batch_size != bs:
            raise ValueError(f"triton captures decode batches only (got {batch.mode.value}, "
                             f"{batch.batch_size} rows for a graph of {bs})")
        context = self._graph_context or self.ctx.max_context_len or None
        return self._decode_meta(bs, context, batch.seq_lens.device)

    def _meta(self, batch: ForwardBatch) -> TritonMeta:
        if not isinstance(batch.attn_meta, TritonMeta):
            batch.attn_meta = self.prepare(batch)
        return batch.attn_meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        Dv = layer.v_head_dim or D
        if layer.sliding_window is not None and layer.sliding_window < 1:
            raise ValueError(f"layer {layer.layer_id}: sliding window must be >= 1 token, "
                             f"got {layer.sliding_window}")
        if layer.logit_softcap is not None and layer.logit_softcap <= 0:
            raise ValueError(f"layer {layer.layer_id}: logit soft-cap must be > 0, "
                             f"got {layer.logit_softcap}")
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, Dv))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta = self._meta(batch)
        q3 = q.view(T, H, D)
        kw = dict(scaling=layer.scaling, k_scale=getattr(pool, "k_scale", 1.0),
                  v_scale=getattr(pool, "v_scale", 1.0), sliding_window=layer.sliding_window,
                  logit_softcap=layer.logit_softcap, sinks=layer.sinks)
        if meta.decode:
            out = decode_attention(q3, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices,
                                   batch.seq_lens, num_splits=meta.num_splits, **kw)
        else:
            out = extend_attention(q3, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices,
                                   batch.seq_lens, batch.extend_lens, meta.q_starts,
                                   meta.max_extend_len, **kw)
        return out.view(T, H * Dv)
