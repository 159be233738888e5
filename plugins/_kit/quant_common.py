"""Torch-op helpers shared by the quant plugins: activation quantization, scale expansion, the
fp32 dequantize-and-matmul reference. Any torch device; the GPU kernels sit beside them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.contract.quant import div_scalar, reciprocal

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
_TINY = 1e-12



def per_token_scale(x: torch.Tensor, qmax: float, ub: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """[M, K] -> fp32 [M, 1]: amax per row / qmax (amax clamped to `ub` where given)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY)
    if ub is not None:
        amax = torch.minimum(amax, ub.float())
    return div_scalar(amax, qmax)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast) saturated to e4m3's range, as e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)


def fp8_acts(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations: x * (1 / scale) saturated to e4m3's range, as e4m3 (core.contract.quant.reciprocal:
    the kernels' rounding). Weights go through quantize_fp8's division."""
    return (x.float() * reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def int8_acts(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations as int8: x * (1 / scale), rounded, clamped."""
    return torch.round(x.float() * reciprocal(scale)).clamp(-128, 127).to(torch.int8)


def per_group_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]): one scale per `group`
    consecutive inputs of a row (DeepSeek / Qwen3-FP8 activations)."""
    m, k = x.shape
    pad = (-k) % group
    xp = F.pad(x.float(), (0, pad)) if pad else x.float()
    g = xp.view(m, -1, group)
    scale = div_scalar(g.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY), FP8_MAX)
    q = fp8_acts(g, scale).view(m, -1)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
                  ) -> torch.Tensor:
    """Block scales [ceil(rows/b0), ceil(cols/b1)] -> one per element [rows, cols]."""
    return (scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            [:rows, :cols])


def reference_linear(x: torch.Tensor, weight_fp32: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 product of already-dequantized operands, cast back to x's dtype."""
    y = x.float() @ weight_fp32.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None,
              fill: float | None = None) -> nn.Parameter:
    t = torch.empty(shape, dtype=dtype, device=device)
    if fill is not None:
        t.fill_(fill)
    return nn.Parameter(t, requires_grad=False)


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set (or drop, with None) a parameter of the layer after loading."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def cuda_capability(device: torch.device) -> int | None:
    """Compute capability as 89 / 90 for a CUDA device, None elsewhere (ROCm included)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor
