"""A CPU backend whose decode kernel reads the paged KV pool in place (numba_cpu, cpu_c).

Prefill / extend are torch_native's. Decode writes the step's K/V into the pool, then hands the
kernel the query in fp32 and the pool's buffers (fp32, or bf16 bit patterns): no gather, no
dense copy. A subclass implements `decode`.

A subclass may also run short extends through its decode kernel: where its `prepare` gives the
step's metadata a `rows` entry (the metadata of one decode row per new token: the token's
request's slots, and the length up to and including that token), the step's K/V go into the
pool and every new token is a decode query over its request's tokens up to itself, which is the
causal extend. Speculative verify steps (a few drafts per request) then run the decode kernel
instead of a gather and a dense prefill, and round as decode steps do.
"""

from __future__ import annotations

import torch

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins._kit.torch_attention import TorchNativeAttention, TorchNativeMeta


class PoolDecodeAttention(TorchNativeAttention):
    label = "pool decode"  # how errors name the backend
    # a kernel that reads bf16 queries and writes outputs in the query's dtype itself (cpu_c):
    # decode then gets q as it is (contiguous), sparing two conversions a layer
    native_bf16_q = False

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        if torch.device(ctx.device).type != "cpu":
            raise ValueError(f"{self.label} runs on the CPU only, not on {ctx.device}")
        if ctx.kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{self.label} reads float32 or bfloat16 KV caches, not "
                             f"{ctx.kv_dtype}")
        self._dense = None  # torch_native's dense decode copy: this decode needs none

    def decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               layer: AttentionLayerParams, meta: TorchNativeMeta) -> torch.Tensor:
        """q [B, H, D] fp32 contiguous, the layer's pool buffers -> [B, H * Dv] fp32."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        meta = self._meta(batch)
        if not meta.decode:
            rows = getattr(meta, "rows", None)
            if rows is None:
                return super().forward(q, k, v, layer, batch)
            meta = rows  # a short extend: one decode row per new token (module docstring)
        B = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        Dv = layer.v_head_dim or D
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(B, Hkv, D), v.view(B, Hkv, Dv))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        qf = q.view(B, H, D)
        if self.native_bf16_q and qf.dtype in (torch.float32, torch.bfloat16):
            return self.decode(qf.contiguous(), k_buf, v_buf, layer, meta)
        if qf.dtype != torch.float32 or not qf.is_contiguous():
            qf = qf.to(torch.float32).contiguous()
        out = self.decode(qf, k_buf, v_buf, layer, meta)
        return out if q.dtype == torch.float32 else out.to(q.dtype)
