"""TritonLayerOps: core.contract.layer_ops.LayerOps over the kernels of plugins/ops/triton/kernels.py."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from core.layers import ops_ref
from plugins.ops.triton import gemv, kernels

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _store(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor,
           v_buf: torch.Tensor) -> bool:
    if not kernels.can_store_kv(k, v, k_buf, v_buf):
        return False
    kernels.store_kv(k, v, loc, k_buf, v_buf)
    return True


def _qk_norm_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                    num_k: int, *, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return ops_ref.qk_norm_rotary(qkv, cos, sin, num_q, num_k,
                                      partial(ops_ref.rms_norm, weight=q_weight, eps=eps),
                                      partial(ops_ref.rms_norm, weight=k_weight, eps=eps),
                                      head_dim)
    return kernels.qk_norm_rotary(qkv, cos, sin, num_q, num_k, q_weight, k_weight, eps,
                                  head_dim)


def _rotary_mla(q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if (q_rope.stride(-1) != 1 or k_rope.stride(-1) != 1 or cos.stride(-1) != 1
            or sin.stride(-1) != 1):
        return ops_ref.rotary_mla(q_rope, k_rope, cos, sin, interleaved)
    return kernels.rotary_mla(q_rope, k_rope, cos, sin, interleaved)


class TritonLayerOps:
    name = "triton"

    def __init__(self, dtype: Any = None, device: Any = None):
        self.dtype, self.device = dtype, device
        kernels._kernels()  # compile-on-demand namespace: a broken triton fails here, at build

    def rms_norm(self, weight: torch.Tensor, eps: float) -> Callable | None:
        if weight.dtype not in _DTYPES:
            return None
        return partial(kernels.rms_norm, weight=weight, eps=eps)

    def add_rms_norm(self, weight: torch.Tensor, eps: float) -> Callable | None:
        if weight.dtype not in _DTYPES:
            return None
        return partial(kernels.add_rms_norm, weight=weight, eps=eps)

    def norm_add_norm(self, weight1: torch.Tensor, weight2: torch.Tensor, eps: float
                      ) -> Callable | None:
        # both weights in the compute dtype (else: the layers compose rms_norm, add_rms_norm)
        if (self.dtype not in _DTYPES or weight1.dtype != self.dtype
                or weight2.dtype != self.dtype or weight1.shape != weight2.shape):
            return None
        return partial(kernels.norm_add_norm, weight1=weight1, weight2=weight2, eps=eps)

    def silu_and_mul(self) -> Callable | None:
        return kernels.silu_and_mul if self.dtype in _DTYPES else None

    def gelu_and_mul(self, approximate: str) -> Callable | None:
        if self.dtype not in _DTYPES or approximate not in ops_ref.GELU_APPROXIMATE:
            return None
        return partial(kernels.gelu_and_mul, approximate=approximate)

    def rotary_qk(self, head_dim: int) -> Callable | None:
        half = head_dim // 2
        # one program rotates every head of a token: HALF must be a power of two for tl.arange
        if head_dim % 2 or half & (half - 1) or self.dtype not in _DTYPES:
            return None
        return partial(kernels.rotary_qk, head_dim=head_dim)

    def rotary_mla(self, rope_dim: int, interleaved: bool) -> Callable | None:
        half = rope_dim // 2
        if rope_dim % 2 or half & (half - 1) or self.dtype not in _DTYPES:
            return None
        return partial(_rotary_mla, interleaved=interleaved)

    def store_kv(self) -> Callable:
        return _store

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
        if not gemv.takes(weight) or weight.dtype != self.dtype:
            return None
        return gemv.linear(weight, bias)

    def qk_norm_rotary(self, head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float) -> Callable | None:
        half = head_dim // 2
        if (head_dim % 2 or half & (half - 1) or self.dtype not in _DTYPES
                or q_weight.dtype != self.dtype or k_weight.dtype != self.dtype
                or q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
            return None
        return partial(_qk_norm_rotary, q_weight=q_weight, k_weight=k_weight, eps=eps,
                       head_dim=head_dim)
