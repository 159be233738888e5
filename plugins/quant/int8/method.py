"""The w8a8_int8 linear method. After loading a layer holds `weight` int8 [N, K], `weight_scale`
fp32 [N, 1] and, for static activations, `input_scale` fp32 []."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.contract.quant import QuantMethod, QuantScheme, mark
from plugins._kit.quant_common import (
    INT8_MAX,
    int8_acts,
    parameter,
    per_token_scale,
    quantize_int8,
    replace_param,
)

_MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows


class Int8LinearMethod(QuantMethod):
    def __init__(self, scheme: QuantScheme):
        if scheme.format != "int8_channel":
            raise ValueError(f"w8a8_int8 cannot compute {scheme.format} weights")
        super().__init__(scheme)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        shards = len(getattr(layer, "output_sizes", [output_size]))
        layer.bias = parameter((output_size,), dtype, device) if bias else None
        if self.scheme.online:
            layer.weight = parameter((output_size, input_size), dtype, device)
            return
        layer.weight = parameter((output_size, input_size), torch.int8, device)
        layer.weight_scale = mark(parameter((output_size, 1), torch.float32, device, 1.0))
        if self.scheme.activations == "static":
            layer.input_scale = mark(parameter((shards,), torch.float32, device, 1.0),
                                     per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.online:
            w = layer.weight.data
            scale = per_token_scale(w, INT8_MAX)
            replace_param(layer, "weight", quantize_int8(w, scale))
            replace_param(layer, "weight_scale", scale)
        else:
            replace_param(layer, "weight_scale", layer.weight_scale.data.float())
        if getattr(layer, "input_scale", None) is not None:
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(()))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        linear = gpu_int8_linear if x.is_cuda else int8_linear
        y = linear(x.reshape(-1, shape[-1]), layer.weight, layer.weight_scale,
                   getattr(layer, "input_scale", None), layer.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


def gpu_int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """CUDA: decode-sized M in one fused Triton launch; larger M: activations quantized in one
    launch, then the Triton scaled GEMM (int32 dots, both scales applied per K step)."""
    from plugins._kit.w8a8_triton import SMALL_M, quantize_acts, scaled_mm, small_m_linear

    if x.shape[0] <= SMALL_M:
        return small_m_linear(x, weight, weight_scale, bias,
                              "static" if input_scale is not None else "token",
                              input_scale=input_scale)
    if input_scale is not None:
        xs = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = int8_acts(x, xs)
    else:
        xq, xs = quantize_acts(x, torch.int8)
    return scaled_mm(xq, xs, weight, weight_scale, 1, x.shape[1], x.dtype, bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N]: int8 activations (per token, or the static scale), int32 product,
    both scales and the bias applied in fp32."""
    m = x.shape[0]
    xs = (input_scale.reshape(1, 1).expand(m, 1) if input_scale is not None
          else per_token_scale(x, INT8_MAX))
    xq = int8_acts(x, xs)
    pad = max(0, _MIN_ROWS - m) if x.is_cuda else 0
    if pad:
        xq = F.pad(xq, (0, 0, 0, pad))
    acc = torch._int_mm(xq, weight.t())
    if pad:
        acc = acc[:m]
    y = acc.float() * xs * weight_scale.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
