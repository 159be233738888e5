"""Torch ops over INT4 checkpoint tensors: unpacking each format's nibbles, the one layout the
kernels read, and the dequantize-and-matmul path for devices without the Triton kernel.

The kernels' layout (both formats, and compressed-tensors pack-quantized, end in it):
  w_q      int32 [K/8, N]   int32 r of column n holds inputs 8r..8r+7 in nibbles 0..7
  w_scales fp16/fp32 [G, N] one scale per group of `group` inputs (G = K / group)
  w_zeros  uint8 [G, N]     the zero each group's nibbles are offset by (0..16)
so that W^T[k, n] = (nibble(k, n) - w_zeros[k // group, n]) * w_scales[k // group, n].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Output j of an AWQ int32 sits in nibble AWQ_NIBBLE[j] (AutoAWQ packs outputs 0,2,4,6,1,3,5,7).
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_last(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., 8C]: value 8c + i is nibble i of word c."""
    shifts = _SHIFTS.to(packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops sign
    return nibbles.to(torch.uint8).reshape(*packed.shape[:-1], -1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, N/8] (outputs interleaved) -> uint8 [R, N] in output order."""
    seq = unpack_last(packed)  # [R, N] in nibble order
    groups = seq.reshape(seq.shape[0], -1, 8)
    index = torch.tensor(AWQ_NIBBLE, device=packed.device)
    return groups.index_select(-1, index).reshape(seq.shape)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] packed along K -> uint8 [K, N]."""
    k8, n = packed.shape
    return unpack_last(packed.t().contiguous()).reshape(n, k8 * 8).t()


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 / int [K, N] nibbles -> int32 [K/8, N] packed along K (the kernels' layout)."""
    k, n = q.shape
    v = q.to(torch.int32).reshape(k // 8, 8, n)
    out = torch.zeros((k // 8, n), dtype=torch.int32, device=q.device)
    for i in range(8):
        out |= v[:, i] << (4 * i)  # nibble 7 lands in the sign bit: the int32 wraps, as stored
    return out


def dequantize(w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The kernels' layout -> W^T [K, N] in `dtype` ((q - z) * s computed in fp32)."""
    q = unpack_rows(w_q).float()
    k = q.shape[0]
    s = scales.float().repeat_interleave(group, 0)[:k]
    z = zeros.float().repeat_interleave(group, 0)[:k]
    return ((q - z) * s).to(dtype)


def dequant_linear(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N]: the whole weight dequantized to x's dtype on every call (nothing
    cached: the int4 tensors stay the only copy), then one matmul."""
    w_t = dequantize(w_q, scales, zeros, group, x.dtype)  # [K, N]
    return F.linear(x, w_t.t(), bias)
