"""The reference layer ops in plain PyTorch (the built-in `torch` layer-ops plugin's factory).

The layers' own math, one op at a time; every device runs it. See core/contract/layer_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from core.layers.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, in fp32 like HF Llama, cast back before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: Callable
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return norm(total), total


def norm_add_norm(h: torch.Tensor, residual: torch.Tensor, norm1: Callable, add_norm2: Callable
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm2(residual + norm1(h)), residual + norm1(h)): norm1(h) rounded to h's dtype before
    the add, as the two ops run one after the other round it."""
    return add_norm2(norm1(h), residual)


def compose_norm_add_norm(norm1: Callable, add_norm2: Callable) -> Callable:
    """norm_add_norm over the given callables (any plugin's rms_norm and add_rms_norm)."""
    return partial(norm_add_norm, norm1=norm1, add_norm2=add_norm2)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


GELU_APPROXIMATE = ("tanh", "none")


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int, num_k: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = qkv.shape[0]
    q_size, qk_size = num_q * head_dim, (num_q + num_k) * head_dim
    # q and k heads rotated in one pass: [T, num_q + num_k, D]
    qk = apply_rotary(qkv[:, :qk_size].view(T, num_q + num_k, head_dim), cos, sin)
    return qk[:, :num_q].reshape(T, q_size), qk[:, num_q:].reshape(T, qk_size - q_size)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] in pairs (x0, x1), (x2, x3), ... -> [..., D] as [x0, x2, ... | x1, x3, ...]."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def rotary_mla(q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rope [T, H, Dr], k_rope [T, Dr] -> both rotated (k as one shared head)."""
    k = k_rope.unsqueeze(1)
    if interleaved:
        q_rope, k = deinterleave(q_rope), deinterleave(k)
    return apply_rotary(q_rope, cos, sin), apply_rotary(k, cos, sin).squeeze(1)


def qk_norm_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                   num_k: int, q_norm: Callable, k_norm: Callable, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: RMSNorm over each q and k head (q_norm / k_norm, rms_norm callables over the last
    dim), then rotary; returns (q [T, num_q * D], k [T, num_k * D]) as rotary_qk does."""
    T, D = qkv.shape[0], head_dim
    q_size, qk_size = num_q * D, (num_q + num_k) * D
    q = apply_rotary(q_norm(qkv[:, :q_size].reshape(T, num_q, D)), cos, sin)
    k = apply_rotary(k_norm(qkv[:, q_size:qk_size].reshape(T, num_k, D)), cos, sin)
    return q.reshape(T, q_size), k.reshape(T, qk_size - q_size)


def compose_qk_norm_rotary(q_norm: Callable, k_norm: Callable, head_dim: int) -> Callable:
    """qk_norm_rotary over the given norm callables (any plugin's rms_norm)."""
    return partial(qk_norm_rotary, q_norm=q_norm, k_norm=k_norm, head_dim=head_dim)


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor,
             v_buf: torch.Tensor) -> bool:
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)
    return True


class TorchLayerOps:
    """core.contract.layer_ops.LayerOps in PyTorch: provides every op, for every dtype and device."""

    name = "torch"

    def __init__(self, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.dtype, self.device = dtype, device

    def rms_norm(self, weight: torch.Tensor, eps: float) -> Callable:
        if weight.dtype == torch.float32:  # one fused op; the same math when nothing casts
            return partial(F.rms_norm, normalized_shape=(weight.shape[0],), weight=weight,
                           eps=eps)
        return partial(rms_norm, weight=weight, eps=eps)

    def add_rms_norm(self, weight: torch.Tensor, eps: float) -> Callable:
        return partial(add_rms_norm, norm=self.rms_norm(weight, eps))

    def norm_add_norm(self, weight1: torch.Tensor, weight2: torch.Tensor, eps: float
                      ) -> Callable:
        return compose_norm_add_norm(self.rms_norm(weight1, eps), self.add_rms_norm(weight2, eps))

    def silu_and_mul(self) -> Callable:
        return silu_and_mul

    def rotary_qk(self, head_dim: int) -> Callable:
        return partial(rotary_qk, head_dim=head_dim)

    def store_kv(self) -> Callable:
        return store_kv

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable:
        return partial(F.linear, weight=weight, bias=bias)

    def qk_norm_rotary(self, head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float) -> Callable:
        return compose_qk_norm_rotary(self.rms_norm(q_weight, eps), self.rms_norm(k_weight, eps),
                                      head_dim)

    def rotary_mla(self, rope_dim: int, interleaved: bool) -> Callable:
        return partial(rotary_mla, interleaved=interleaved)

    def gelu_and_mul(self, approximate: str) -> Callable:
        if approximate not in GELU_APPROXIMATE:
            raise ValueError(f"gelu approximate must be one of {GELU_APPROXIMATE}, not "
                             f"{approximate!r}")
        return partial(gelu_and_mul, approximate=approximate)
