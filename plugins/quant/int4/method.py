"""The INT4 weight-only linear method (awq, gptq, compressed-tensors pack-quantized).

Creates the checkpoint's own tensors (names, dtypes and layouts as the format stores them),
moves them after loading into the one layout the kernels read (plugins.quant.int4.packing:
`w_q` int32 [K/8, N], `w_scales` [K/g, N], `w_zeros` uint8 [K/g, N]) and drops the checkpoint's,
and applies them with the kernel chosen once at process time: on CUDA sm80+ the Triton GEMV for one
row, the Triton dequant-GEMM below DEQUANT_ROWS rows, and from there the weight dequantized by
one Triton launch and multiplied by cuBLAS; on other devices the dequantize-per-call torch path.
"""

from __future__ import annotations

import torch
from torch import nn

from core.contract.quant import QuantMethod, QuantScheme, mark
from plugins._kit.quant_common import cuda_capability, parameter, replace_param
from plugins.quant.int4.packing import (
    dequant_linear,
    pack_rows,
    unpack_awq,
    unpack_last,
)

FORMATS = ("int4_awq", "int4_gptq", "int4_pack")
_ALL_EIGHTS = -0x77777778  # 0x88888888 as int32: zero 8 in every nibble


def _whole_layer(layer: nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, rows: list[torch.Tensor]) -> nn.Parameter:
    """A tensor the checkpoint gives once per projection, whole (g_idx, weight_shape): one row
    per stacked shard (each checked after loading), or the tensor itself for a plain linear.
    `rows`: each shard's expected value, the fill (so dummy weights pass the checks)."""
    if getattr(layer, "shard_names", None) is None:
        p = parameter(shape, dtype, device)
        p.data.copy_(rows[0])
        return mark(p, out_dim=None)
    p = parameter((len(rows), *shape), dtype, device)
    p.data.copy_(torch.stack(rows))
    return mark(p, per_shard=True)


class Int4LinearMethod(QuantMethod):
    def __init__(self, scheme: QuantScheme):
        if scheme.format not in FORMATS:
            raise ValueError(f"int4 cannot compute {scheme.format} weights")
        if scheme.weight_bits not in (None, 4):
            raise ValueError(f"int4: {scheme.weight_bits}-bit weights")
        super().__init__(scheme)

    # ---- creation: the checkpoint's own tensor names and shapes ----

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        s, k, n = self.scheme, input_size, output_size
        sizes = list(getattr(layer, "output_sizes", [n]))
        group = s.group_size or k  # None: one group over K (GPTQ group_size -1)
        if k % group or k % 8 or any(size % 8 for size in sizes):
            raise ValueError(f"int4 {s.format}: linear {k} -> {sizes} needs K a multiple of 8 "
                             f"and of the group size {group}, and every output a multiple of 8")
        groups = k // group
        i32, f32 = torch.int32, torch.float32
        layer.bias = parameter((n,), dtype, device) if bias else None
        layer.int4_group = group
        # Scales are read in fp32 (exact for the fp16 / bf16 checkpoints store); the copy the
        # kernels read is narrowed again after loading.
        if s.format == "int4_awq":
            layer.qweight = mark(parameter((k, n // 8), i32, device, 0), out_dim=1,
                                 out_per_row=8)
            layer.qzeros = mark(parameter((groups, n // 8), i32, device, _ALL_EIGHTS),
                                out_dim=1, out_per_row=8)
            layer.scales = mark(parameter((groups, n), f32, device, 1.0), out_dim=1)
        elif s.format == "int4_gptq":
            v1 = s.checkpoint_format != "gptq_v2"
            layer.qweight = mark(parameter((k // 8, n), i32, device, 0), out_dim=1)
            layer.qzeros = mark(parameter((groups, n // 8), i32, device,
                                          0x77777777 if v1 else _ALL_EIGHTS),
                                out_dim=1, out_per_row=8)
            layer.scales = mark(parameter((groups, n), f32, device, 1.0), out_dim=1)
            trivial = (torch.arange(k) // group).to(i32)
            layer.g_idx = _whole_layer(layer, (k,), i32, device, [trivial] * len(sizes))
        else:  # int4_pack: compressed-tensors, output rows first
            layer.weight_packed = mark(parameter((n, k // 8), i32, device, 0))
            layer.weight_scale = mark(parameter((n, groups), f32, device, 1.0))
            layer.weight_shape = _whole_layer(layer, (2,), torch.int64, device,
                                              [torch.tensor([size, k]) for size in sizes])
            if s.zero_point:
                layer.weight_zero_point = mark(parameter((n // 8, groups), i32, device,
                                                         _ALL_EIGHTS), out_per_row=8)

    def init_dummy_weights(self, layer: nn.Module, seed: int, std: float) -> None:
        """--load-format dummy: random nibbles around the default zero (8) and scales that make
        the real weights about `std` in size (the loader set every scale to 1)."""
        gen = torch.Generator().manual_seed(seed)
        packed = {"int4_awq": "qweight", "int4_gptq": "qweight"}.get(self.scheme.format,
                                                                      "weight_packed")
        p = getattr(layer, packed)
        p.data.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, p.shape, dtype=torch.int64,
                                   generator=gen).to(torch.int32).to(p.device))
        scales = layer.scales if hasattr(layer, "scales") else layer.weight_scale
        scales.data.fill_(std / 4.0)  # nibbles 0..15 around 8: |q - z| <= 8

    # ---- after loading: the kernels' layout ----

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.scheme
        if s.format == "int4_awq":
            w_q = pack_rows(unpack_awq(layer.qweight.data))       # [K, N] -> [K/8, N]
            zeros = unpack_awq(layer.qzeros.data)                  # [G, N]
            scales = layer.scales.data
            dropped = ("qweight", "qzeros", "scales")
        elif s.format == "int4_gptq":
            _check_g_idx(layer.g_idx.data, layer.int4_group)
            w_q = layer.qweight.data                               # already [K/8, N]
            zeros = unpack_last(layer.qzeros.data)                 # [G, N]
            if s.checkpoint_format != "gptq_v2":
                zeros = zeros + 1  # the "gptq" format stores each zero minus one
            scales = layer.scales.data
            dropped = ("qweight", "qzeros", "scales", "g_idx")
        else:
            _check_shapes(layer)
            w_q = pack_rows(unpack_last(layer.weight_packed.data).t())  # [N, K] -> [K/8, N]
            scales = layer.weight_scale.data.t()                   # [G, N]
            zp = getattr(layer, "weight_zero_point", None)
            zeros = (unpack_last(zp.data.t().contiguous()) if zp is not None   # [G, N]
                     else torch.full(scales.shape, 8, dtype=torch.uint8, device=scales.device))
            dropped = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
        for name in dropped:
            replace_param(layer, name, None)
        replace_param(layer, "w_q", w_q.contiguous())
        replace_param(layer, "w_scales", _narrow_scales(scales).contiguous())
        replace_param(layer, "w_zeros", zeros.to(torch.uint8).contiguous())
        cap = cuda_capability(w_q.device)
        layer.int4_kernel = "triton" if cap is not None and cap >= 80 else "dequant"
        layer.int4_sms = (torch.cuda.get_device_properties(w_q.device).multi_processor_count
                          if layer.int4_kernel == "triton" else 1)

    # ---- compute ----

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.int4_kernel == "triton":
            from plugins.quant.int4 import gemm

            m = x2.shape[0]
            args = (x2, layer.w_q, layer.w_scales, layer.w_zeros, layer.int4_group, layer.bias)
            if m == 1:
                y = gemm.int4_gemv(*args, layer.int4_sms)
            elif m < DEQUANT_ROWS:
                y = gemm.int4_linear(*args, layer.int4_sms)
            else:
                y = gemm.int4_dequant_linear(*args)
        else:
            y = dequant_linear(x2, layer.w_q, layer.w_scales, layer.w_zeros, layer.int4_group,
                               layer.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


# From this many rows the weight is dequantized to the compute dtype per call (one Triton
# launch on CUDA) and multiplied by the vendor GEMM (bench/sweep_quant.py --only int4 on an
# H200, 2026-12-02): at M=16 the dequant-GEMM is faster (qkv 22.8 us against 31.1, down 40.5
# against 76.2), at M=64 dequantize + cuBLAS is (31.5 against 64.4, 77.0 against 110.9); at
# M=4096 dequantize + cuBLAS runs 0.94-1.06x bf16 where the dequant-GEMM ran 0.25-0.29x.
DEQUANT_ROWS = 64


def _narrow_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp16 where that holds every scale exactly (what AWQ / GPTQ store), else fp32."""
    half = scales.half()
    return half if torch.equal(half.float(), scales.float()) else scales.float()


def _check_g_idx(g_idx: torch.Tensor, group: int) -> None:
    rows = g_idx.reshape(-1, g_idx.shape[-1])
    trivial = torch.arange(rows.shape[-1], device=g_idx.device) // group
    if not torch.equal(rows.long(), trivial.expand_as(rows).long()):
        raise ValueError(f"gptq: g_idx is not input // group_size ({group}): act-order "
                         "(desc_act) checkpoints, whose groups are permuted, are not supported")


def _check_shapes(layer: nn.Module) -> None:
    got = layer.weight_shape.data.reshape(-1, 2).tolist()
    want = [[size, layer.input_size] for size in getattr(layer, "output_sizes",
                                                          [layer.output_size])]
    if got != want:
        raise ValueError(f"compressed-tensors: weight_shape {got} does not match the linear's "
                         f"{want}")
