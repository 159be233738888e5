"""The fp8 linear method: creates the checkpoint's tensors, normalizes them after loading to
one of two forms, and applies them with the kernel chosen once for the device.

After `process_weights_after_loading` a layer holds `weight` e4m3 [N, K] and either
`weight_scale` fp32 [N, 1] (per output channel; per-tensor checkpoints are expanded to it, which
is exact) or `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] (block-wise); `input_scale` fp32
[] for static activations; `input_scale_ub` (a buffer, from the config's activation_scale_ub) for FBGEMM's clamp of
dynamic activation amax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.contract.quant import QuantMethod, QuantScheme, mark
from plugins._kit.quant_common import (
    FP8,
    FP8_MAX,
    cuda_capability,
    expand_blocks,
    fp8_acts,
    parameter,
    per_group_fp8,
    per_token_scale,
    quantize_fp8,
    reference_linear,
    replace_param,
)


class Fp8LinearMethod(QuantMethod):
    def __init__(self, scheme: QuantScheme):
        if scheme.format not in ("fp8_block", "fp8_channel", "fp8_tensor"):
            raise ValueError(f"fp8 cannot compute {scheme.format} weights")
        super().__init__(scheme)

    # ---- creation: the checkpoint's own tensor names and shapes ----

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        s = self.scheme
        shards = len(getattr(layer, "output_sizes", [output_size]))
        layer.bias = parameter((output_size,), dtype, device) if bias else None
        if s.online:  # a dense checkpoint, quantized in process_weights_after_loading
            layer.weight = parameter((output_size, input_size), dtype, device)
            return
        layer.weight = parameter((output_size, input_size), FP8, device)
        if s.format == "fp8_block":
            bn, bk = s.block
            name = "weight_scale_inv" if s.method == "fp8" else "weight_scale"
            scale = parameter((-(-output_size // bn), -(-input_size // bk)), torch.float32,
                              device, fill=1.0)
            setattr(layer, name, mark(scale, out_per_row=bn))
        elif s.format == "fp8_channel":
            layer.weight_scale = mark(parameter((output_size, 1), torch.float32, device, 1.0))
        else:  # per tensor: one scale per stacked shard
            layer.weight_scale = mark(parameter((shards,), torch.float32, device, 1.0),
                                      per_shard=True)
        if s.activations == "static":
            layer.input_scale = mark(parameter((shards,), torch.float32, device, 1.0),
                                     per_shard=True)
        if s.method == "fbgemm_fp8":  # the clamp of dynamic scales is the config's, not a tensor
            ub = float(s.raw.get("activation_scale_ub", 1200.0))
            layer.register_buffer("input_scale_ub", torch.tensor([[ub]], device=device),
                                  persistent=False)

    # ---- after loading: one form, one kernel ----

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.scheme
        if s.online:
            w = layer.weight.data
            scale = per_token_scale(w, FP8_MAX)  # per output row
            replace_param(layer, "weight", quantize_fp8(w, scale))
            replace_param(layer, "weight_scale", scale)
        elif s.format == "fp8_block" and s.method != "fp8":
            replace_param(layer, "weight_scale_inv", layer.weight_scale.data)
            replace_param(layer, "weight_scale", None)
        elif s.format == "fp8_tensor":
            per_shard = layer.weight_scale.data
            rows = torch.tensor(layer.output_sizes, device=per_shard.device)
            replace_param(layer, "weight_scale",
                          per_shard.repeat_interleave(rows).unsqueeze(1).contiguous())
        if hasattr(layer, "input_scale") and layer.input_scale is not None:
            # One x feeds every shard: the largest calibrated scale covers all of them.
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(()))
        layer.fp8_kernel = self._kernel(layer)

    def _kernel(self, layer: nn.Module) -> str:
        cap = cuda_capability(layer.weight.device)
        return "reference" if cap is None or cap < 89 else "triton"

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """e4m3 codes times their scales in fp32 (block scales expanded over the blocks, a
        partial last block included; per-channel ones per row): what `reference_fp8_linear`
        multiplies by, so exact in the same sense."""
        n, k = layer.weight.shape
        w = layer.weight.float()
        if hasattr(layer, "weight_scale_inv"):
            return w * expand_blocks(layer.weight_scale_inv.float(), n, k, self.scheme.block)
        return w * layer.weight_scale.float()

    # ---- compute ----

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.fp8_kernel == "triton":
            y = _gpu_linear(x2, layer, self.scheme)
        else:
            y = reference_fp8_linear(x2, layer, self.scheme)
        return y.reshape(*shape[:-1], y.shape[-1])

    # ---- MoE experts (form "fp8" of core.contract.moe.MoEWeights) ----

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        """w13 [E, 2I, H] / w2 [E, H, I] in e4m3 with their scales under the checkpoint's
        per-expert names (w13_weight_scale_inv ...); a dense checkpoint quantized at load keeps
        compute-dtype weights until process_moe_weights_after_loading."""
        s = self.scheme
        if s.activations == "static":
            raise ValueError("fp8 experts with static activation scales are not supported")
        shapes = {"w13": (2 * intermediate_size, hidden_size), "w2": (hidden_size,
                                                                       intermediate_size)}
        for name, (n, k) in shapes.items():
            w = parameter((num_experts, n, k), dtype if s.online else FP8, device)
            setattr(layer, f"{name}_weight", w)
            if s.online:
                continue
            if s.format == "fp8_block":
                bn, bk = s.block
                scale = parameter((num_experts, -(-n // bn), -(-k // bk)), torch.float32,
                                  device, fill=1.0)
                suffix = "weight_scale_inv" if s.method == "fp8" else "weight_scale"
                setattr(layer, f"{name}_{suffix}", mark(scale, out_per_row=bn))
            elif s.format == "fp8_channel":
                setattr(layer, f"{name}_weight_scale",
                        mark(parameter((num_experts, n, 1), torch.float32, device, 1.0)))
            else:  # per tensor: one scale per expert and projection
                parts = 2 if name == "w13" else 1
                setattr(layer, f"{name}_weight_scale",
                        mark(parameter((num_experts, parts), torch.float32, device, 1.0),
                             out_per_row=intermediate_size))

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """Every form to e4m3 weights + fp32 scales: [E, N, 1] per channel, or the checkpoint's
        blocks [E, N/bn, K/bk] (then `moe_block` holds (bn, bk))."""
        s = self.scheme
        layer.moe_block = s.block if s.format == "fp8_block" else None
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data
            if s.online:
                scale = per_token_scale(w.reshape(-1, w.shape[-1]), FP8_MAX).reshape(
                    w.shape[0], w.shape[1], 1)
                replace_param(layer, f"{name}_weight", quantize_fp8(w, scale))
            elif s.format == "fp8_block":
                scale = getattr(layer, f"{name}_weight_scale_inv" if s.method == "fp8"
                                else f"{name}_weight_scale").data
            elif s.format == "fp8_tensor":  # [E, parts] -> one per output row
                per = getattr(layer, f"{name}_weight_scale").data
                scale = per.repeat_interleave(w.shape[1] // per.shape[1], dim=1).unsqueeze(-1)
            else:
                scale = getattr(layer, f"{name}_weight_scale").data
            for suffix in ("weight_scale", "weight_scale_inv"):
                replace_param(layer, f"{name}_{suffix}", None)
            layer.register_buffer(f"{name}_scale", scale.float().contiguous(), persistent=False)

    def moe_weights(self, layer: nn.Module):
        from core.contract.moe import MoEWeights

        extra = {"w13_scale": layer.w13_scale, "w2_scale": layer.w2_scale}
        if layer.moe_block is not None:
            extra["block"] = torch.tensor(layer.moe_block)
        return MoEWeights(layer.w13_weight, layer.w2_weight, form="fp8", extra=extra)


def _act_quant(x: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, fp32 scale [M, 1]) for per-token dynamic or static per-tensor activations
    (torch ops: the reference and the static GPU path)."""
    static = getattr(layer, "input_scale", None)
    if static is not None:
        scale = static.reshape(1, 1).expand(x.shape[0], 1)
    else:
        scale = per_token_scale(x, FP8_MAX, getattr(layer, "input_scale_ub", None))
    return fp8_acts(x, scale), scale.float()


def _gpu_linear(x: torch.Tensor, layer: nn.Module, scheme: QuantScheme) -> torch.Tensor:
    """CUDA sm89+: one fused Triton launch for decode-sized M; otherwise the activations
    quantized in one launch, then the block-scaled Triton GEMM or cuBLASLt's `_scaled_mm`."""
    from plugins._kit.w8a8_triton import SMALL_M, quantize_acts, scaled_mm, small_m_linear

    blocked = hasattr(layer, "weight_scale_inv")
    static = getattr(layer, "input_scale", None)
    ub = getattr(layer, "input_scale_ub", None)
    if x.shape[0] <= SMALL_M:
        if blocked:
            return small_m_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, "group",
                                  scheme.block)
        return small_m_linear(x, layer.weight, layer.weight_scale, layer.bias,
                              "static" if static is not None else "token",
                              input_scale=static, ub=ub)
    if blocked:
        xq, xs = quantize_acts(x, FP8, group=scheme.block[1])
        return scaled_mm(xq, xs, layer.weight, layer.weight_scale_inv, scheme.block[0],
                         scheme.block[1], x.dtype, layer.bias)
    if static is not None:
        xq, xs = _act_quant(x, layer)
    else:
        xq, xs = quantize_acts(x, FP8, ub=ub)
    return _scaled_mm_linear(xq, xs, layer, x.dtype)


def _scaled_mm_linear(xq: torch.Tensor, xs: torch.Tensor, layer: nn.Module,
                      out_dtype: torch.dtype) -> torch.Tensor:
    ws = layer.weight_scale  # [N, 1]
    m = xq.shape[0]
    pad = (-m) % 16  # cuBLASLt fp8 wants rows in multiples of 16
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
        xs = F.pad(xs, (0, 0, 0, pad), value=1.0)
    if out_dtype == torch.bfloat16:  # row-wise scaling is fused for bf16 output
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=ws.t(),
                             out_dtype=out_dtype, bias=layer.bias)
    else:
        one = torch.ones((), device=xq.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=one, scale_b=one,
                             out_dtype=torch.float32)
        y = y * xs * ws.t()
        if layer.bias is not None:
            y = y + layer.bias.float()
        y = y.to(out_dtype)
    return y[:m] if pad else y


def reference_fp8_linear(x: torch.Tensor, layer: nn.Module, scheme: QuantScheme
                         ) -> torch.Tensor:
    """The same numbers as the GPU kernels, in fp32 torch ops on any device: activations
    quantized as the scheme says, both operands dequantized, one fp32 matmul."""
    n, k = layer.weight.shape
    w = layer.weight.float()
    if hasattr(layer, "weight_scale_inv"):
        w = w * expand_blocks(layer.weight_scale_inv.float(), n, k, scheme.block)
        xq, xs = per_group_fp8(x, scheme.act_group or scheme.block[1])
        xd = xq.float() * xs.repeat_interleave(scheme.act_group or scheme.block[1], 1)[:, :k]
    else:
        w = w * layer.weight_scale.float()
        xq, xs = _act_quant(x, layer)
        xd = xq.float() * xs
    return reference_linear(xd.to(torch.float32), w, layer.bias).to(x.dtype)
