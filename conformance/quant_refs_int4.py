"""Reference packers for INT4 weight-only checkpoints, written from the formats' published
descriptions (not from any loader): a dense fp32 weight [N, K] in, the tensors a checkpoint of
that format stores for one linear out, with the fp32 weight they dequantize to.

- AWQ (AutoAWQ, version "gemm"): qweight int32 [K, N/8]; int32 c of row k holds outputs
  8c..8c+7, nibble i (bits 4i..4i+3) holding output 8c + AWQ_ORDER[i]; qzeros int32 [K/g, N/8]
  packed the same way; scales fp16 [K/g, N]; w = (q - z) * s.
- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K/8, N], int32 r of column n holding inputs
  8r..8r+7 in nibbles 0..7; qzeros int32 [K/g, N/8] packed along N in nibbles 0..7, storing
  z - 1 in checkpoint_format "gptq" (z in "gptq_v2"); scales fp16 [K/g, N]; g_idx int32 [K]
  (i // g); w = (q - z) * s. Symmetric checkpoints use z = 8.
- compressed-tensors pack-quantized (W4A16): weight_packed int32 [N, K/8] (inputs 8c..8c+7 in
  nibbles 0..7, each the signed value + 8); weight_scale [N, K/g]; weight_shape int [2];
  asymmetric ones add weight_zero_point int32 [N/8, K/g] packed along N (signed zero + 8);
  w = (q - z) * s in signed values.

Every function returns `(tensors, dequantized)`: name -> tensor as the checkpoint stores it, and
the fp32 [N, K] weight those tensors mean (exactly: computed from the stored values). The
quant-method conformance suite and tests use them; `quantization_config` gives the matching
config.json entry; CASES names one case per format (what bench/ and suites iterate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output AWQ_ORDER[i]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32 (two's complement wrap)."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_last(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[..., 8m] ints in 0..15 -> int32 [..., m]: nibble i of word c holds value 8c + order[i]."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for nibble, src in enumerate(order):
        words |= v[..., src] << (4 * nibble)
    return _to_int32(words)


def quantize_groups(weight: torch.Tensor, group_size: int, symmetric: bool = False,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max 4-bit quantization per `group_size` consecutive inputs of each output row.

    weight fp32 [N, K] -> (q int64 [N, K] in 0..15, scales fp16 [N, K/g], zeros int64
    [N, K/g]). Symmetric: zero 8. `min_zero`: the least zero a format can store (1 for GPTQ's
    "zero minus one" packing). Scales are rounded to fp16 before q is computed, so
    (q - z) * scale is exactly what a checkpoint means.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        amax = w.abs().amax(-1).clamp(min=1e-8)
        scales = (amax / 7.5).half()
        zeros = torch.full_like(amax, 8, dtype=torch.int64)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo).clamp(min=1e-8) / 15).half()
        zeros = torch.round(-lo / scales.float()).to(torch.int64).clamp(min_zero, 15)
    q = torch.round(w / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)
    q = q.clamp(0, 15).to(torch.int64).reshape(n, k)
    return q, scales, zeros


def _dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size).float()
    return ((g - zeros.unsqueeze(-1).float()) * scales.float().unsqueeze(-1)).reshape(n, k)


def awq_tensors(weight: torch.Tensor, group_size: int = 128
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """weight fp32 [N, K] -> ({qweight, qzeros, scales} as AutoAWQ's GEMM version writes them,
    dequantized fp32 [N, K])."""
    q, scales, zeros = quantize_groups(weight, group_size)
    tensors = {
        "qweight": _pack_last(q.t().contiguous(), AWQ_ORDER),      # [K, N/8]
        "qzeros": _pack_last(zeros.t().contiguous(), AWQ_ORDER),   # [K/g, N/8]
        "scales": scales.t().contiguous(),                         # [K/g, N]
    }
    return tensors, _dequantize(q, scales, zeros, group_size)


def gptq_tensors(weight: torch.Tensor, group_size: int = 128, sym: bool = False,
                 checkpoint_format: str = "gptq"
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """weight fp32 [N, K] -> ({qweight, qzeros, scales, g_idx} as AutoGPTQ (checkpoint_format
    "gptq": zeros stored minus one) or GPTQModel ("gptq_v2": zeros as they are) write them,
    dequantized fp32 [N, K]). group_size -1: one group over K."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format {checkpoint_format!r}")
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    v1 = checkpoint_format == "gptq"
    q, scales, zeros = quantize_groups(weight, g, symmetric=sym, min_zero=1 if v1 else 0)
    stored = zeros - 1 if v1 else zeros
    tensors = {
        "qweight": _pack_last(q.t().reshape(k // 8, 8, n).transpose(1, 2)
                              .reshape(k // 8, n * 8)),            # [K/8, N], along K
        "qzeros": _pack_last(stored.t().contiguous()),             # [K/g, N/8], along N
        "scales": scales.t().contiguous(),                         # [K/g, N]
        "g_idx": (torch.arange(k) // g).to(torch.int32),           # [K]
    }
    return tensors, _dequantize(q, scales, zeros, g)


def pack_quantized_tensors(weight: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                           scale_dtype: torch.dtype = torch.bfloat16
                           ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """weight fp32 [N, K] -> ({weight_packed, weight_scale, weight_shape[, weight_zero_point]}
    as compressed-tensors' pack-quantized format writes them, dequantized fp32 [N, K])."""
    n, k = weight.shape
    q, scales, zeros = quantize_groups(weight, group_size, symmetric=symmetric)
    scales = scales.to(scale_dtype)  # fp16 -> bf16 may round: dequantize from what is stored
    tensors = {
        "weight_packed": _pack_last(q),                            # [N, K/8], along K
        "weight_scale": scales,                                    # [N, K/g]
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not symmetric:  # signed zero + 8 == our unsigned zero; packed along N
        tensors["weight_zero_point"] = _pack_last(zeros.t().contiguous()).t().contiguous()
    return tensors, _dequantize(q, scales, zeros, group_size)


def quantization_config(method: str, group_size: int = 128, *, sym: bool = False,
                        checkpoint_format: str = "gptq", symmetric: bool = True) -> dict:
    """The config.json `quantization_config` of a checkpoint these packers write: method
    "awq", "gptq" or "compressed-tensors" (pack-quantized W4A16)."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                "sym": sym, "checkpoint_format": checkpoint_format}
    if method == "compressed-tensors":
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                   "group_size": group_size}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None}},
                "ignore": ["lm_head"]}
    raise ValueError(f"no reference packer for {method!r}")


@dataclass(frozen=True)
class Int4Case:
    """One checkpoint format: its QuantScheme format, config.json entry and packer
    (`build(weight fp32 [N, K]) -> (tensors, dequantized)`)."""

    name: str
    format: str
    config: dict
    build: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


CASES = (
    Int4Case("awq-g128", "int4_awq", quantization_config("awq", 128),
             partial(awq_tensors, group_size=128)),
    Int4Case("gptq-g128", "int4_gptq", quantization_config("gptq", 128),
             partial(gptq_tensors, group_size=128)),
    Int4Case("pack-g128", "int4_pack", quantization_config("compressed-tensors", 128),
             partial(pack_quantized_tensors, group_size=128)),
)
