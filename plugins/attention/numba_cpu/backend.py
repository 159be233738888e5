"""`numba_cpu`: torch_native's prefill, a Numba kernel for decode (CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins._kit.pool_attention import PoolDecodeAttention
from plugins._kit.torch_attention import TorchNativeMeta
from plugins.attention.numba_cpu.kernels import decode_attention


@dataclass
class NumbaMeta(TorchNativeMeta):
    """torch_native's step metadata plus, for decode, the kernel's host arrays."""

    seq_lens_np: np.ndarray | None = None  # [B] int64
    slots_np: np.ndarray | None = None  # [B, max_seq] int64


def _as_numpy(buf: torch.Tensor) -> np.ndarray:
    """A pool buffer as the kernel reads it: fp32 as is, bf16 as its uint16 bit patterns."""
    if buf.dtype == torch.bfloat16:
        buf = buf.view(torch.uint16)
    return buf.numpy()


class NumbaCpuAttention(PoolDecodeAttention):
    """Decode reads the paged pool in place (no gather, no dense copy); extend is inherited."""

    label = "numba_cpu"

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        # per layer: the pool buffers as numpy arrays and the kernel's scalar arguments (built
        # once: at batch 1 on a small model, per-call conversions cost as much as the kernel)
        self._layer_args: dict[int, tuple] = {}
        self._compile(ctx)

    @staticmethod
    def _compile(ctx: BackendContext) -> None:
        """Compile (or load from numba's cache) the kernel for this pool's dtype now, at engine
        start, instead of stalling the first decode step by seconds."""
        H, Hkv, D = ctx.num_heads, ctx.num_kv_heads, ctx.head_dim
        buf = torch.zeros(2, Hkv, D, dtype=ctx.kv_dtype)
        decode_attention(np.zeros((1, H, D), np.float32), _as_numpy(buf), _as_numpy(buf),
                         np.zeros((1, 1), np.int64), np.ones(1, np.int64), np.float32(1.0),
                         np.int64(0), np.float32(0.0), np.empty((1, H, D), np.float32))

    def prepare(self, batch: ForwardBatch) -> NumbaMeta:
        meta = NumbaMeta(**vars(super().prepare(batch)))
        if meta.decode:
            meta.seq_lens_np = np.asarray(meta.seq_lens, dtype=np.int64)
            meta.slots_np = meta.slots.contiguous().numpy()
        return meta

    def decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               layer: AttentionLayerParams, meta: NumbaMeta) -> torch.Tensor:
        cached = self._layer_args.get(layer.layer_id)
        if cached is None or cached[0] is not k_buf or cached[1] is not v_buf:
            cached = (k_buf, v_buf, _as_numpy(k_buf), _as_numpy(v_buf),
                      np.float32(layer.scaling), np.int64(layer.sliding_window or 0),
                      np.float32(layer.logit_softcap or 0.0))
            self._layer_args[layer.layer_id] = cached
        _, _, k_np, v_np, scaling, window, softcap = cached
        B, H = q.shape[0], q.shape[1]
        Dv = v_buf.shape[-1]
        out = torch.empty(B, H, Dv, dtype=torch.float32)
        decode_attention(q.numpy(), k_np, v_np, meta.slots_np, meta.seq_lens_np, scaling,
                         window, softcap, out.numpy())
        return out.reshape(B, H * Dv)
