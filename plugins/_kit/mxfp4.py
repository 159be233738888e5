"""MXFP4 (OCP Microscaling, MX v1.0): the packed layout the `mxfp4` quant method keeps and the
MoE runners read, and its torch dequantization (any device).

Element: FP4 E2M1 (sign, 2 exponent bits with bias 1, 1 mantissa bit; no inf / NaN), so the
16 codes are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 is -0). Block: 32 consecutive elements
along the input dim share one E8M0 scale byte s, worth 2^(s - 127); s = 0xFF is NaN (the
spec's only special value), s = 0 is 2^-127.

Layout (form "mxfp4" of core.contract.moe.MoEWeights), per expert e:
  packed  uint8 [E, N, K/2]   byte j of a row holds element 2j in its low nibble and element
                              2j + 1 in its high nibble (the HF GPT-OSS checkpoint's order)
  scales  uint8 [E, N, K/32]  the E8M0 byte of elements [32g, 32g + 32) of the row
so that W[e, n, k] = e2m1(nibble(packed[e, n, k // 2], k % 2)) * 2^(scales[e, n, k // 32] - 127).
The HF checkpoint's `*_blocks` [E, N, K/32, 16] is this packed tensor with its last dim split
(`from_hf_blocks`); `*_scales` [E, N, K/32] is the scale tensor as it is.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per scale
# E2M1 code -> value (code = sign << 3 | exponent << 1 | mantissa)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 0xFF


def _scale_table() -> torch.Tensor:
    """The 256 E8M0 bytes as exact fp32 (built from bit patterns: 2^-127 is a subnormal, and
    0xFF is NaN)."""
    bits = torch.arange(256, dtype=torch.int64) << 23  # 2^(s - 127) for s in 1..254
    bits[0] = 1 << 22  # 2^-127 = 2^22 * 2^-149
    bits[E8M0_NAN] = 0x7FC00000  # quiet NaN
    return bits.to(torch.int32).view(torch.float32)


_VALUES = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_SCALES = _scale_table()


def check_shape(k: int, what: str) -> None:
    """ValueError unless a row of `k` elements splits into whole scale blocks."""
    if k <= 0 or k % BLOCK:
        raise ValueError(f"mxfp4: {what} has {k} elements per row, not a positive multiple of "
                         f"{BLOCK} (one E8M0 scale per {BLOCK} elements)")


def dequantize(packed: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2] + scales uint8 [..., K/32] -> W [..., K] in `dtype` (computed in
    fp32, where every finite value is exact; cast once). ValueError for mismatched shapes."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: packed values and scales must be uint8, not {packed.dtype} "
                         f"and {scales.dtype}")
    k = packed.shape[-1] * 2
    check_shape(k, "the packed tensor")
    if tuple(scales.shape) != (*packed.shape[:-1], k // BLOCK):
        raise ValueError(f"mxfp4: scales {tuple(scales.shape)} do not match packed values "
                         f"{tuple(packed.shape)} (want {(*packed.shape[:-1], k // BLOCK)})")
    values = _VALUES.to(packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)  # [..., K/2, 2]: low, high
    w = values[codes.long()].reshape(*packed.shape[:-1], k // BLOCK, BLOCK)
    s = _SCALES.to(packed.device)[scales.long()]  # [..., K/32]
    return (w * s.unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(dtype)


def from_hf_blocks(blocks: torch.Tensor, scales: torch.Tensor, what: str = "experts"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `*_blocks` uint8 [..., N, K/32, 16] and `*_scales` uint8 [..., N, K/32] -> (packed
    [..., N, K/2], scales) in the layout above (a view where the blocks are contiguous).
    ValueError naming the tensor for anything else."""
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4 {what}: blocks {tuple(blocks.shape)} are not [..., N, K/32, 16]")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"mxfp4 {what}: scales {tuple(scales.shape)} do not match blocks "
                         f"{tuple(blocks.shape)} (want {tuple(blocks.shape[:-1])})")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 {what}: blocks and scales must be uint8, not {blocks.dtype} "
                         f"and {scales.dtype}")
    packed = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
    return packed, scales


# ---- GPT-OSS checkpoints (HF names under `model.layers.N.mlp.experts.`) ----

# HF leaf -> the mxfp4 method's MoE parameter (plugins/quant/mxfp4/method.py)
HF_EXPERT_TENSORS = {"gate_up_proj_blocks": "w13_blocks", "gate_up_proj_scales": "w13_scales",
                     "gate_up_proj_bias": "w13_bias", "down_proj_blocks": "w2_blocks",
                     "down_proj_scales": "w2_scales", "down_proj_bias": "w2_bias"}


def gate_up_rows(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's interleaved gate_up rows (dim 1 of [E, 2I, ...]: row 2i gate i, row 2i + 1 up
    i) -> core's order (gate rows, then up rows: core.contract.moe.W13_LAYOUT). Rows are whole
    in every mxfp4 tensor (blocks, scales, bias), so packed rows move as they are."""
    if t.dim() < 2 or t.shape[1] % 2:
        raise ValueError(f"gate_up tensor {tuple(t.shape)} has no even row dim 1 to split into "
                         "gate and up rows")
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def gpt_oss_expert_tensor(leaf: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One HF GPT-OSS MXFP4 expert tensor, by its leaf name after `mlp.experts.`
    (gate_up_proj_blocks, ..., down_proj_bias), -> (the MoE layer's parameter name, the tensor
    to hand its weight_loader whole: gate_up rows in core's order). KeyError for other names;
    ValueError for a gate_up tensor without an even row dim."""
    if leaf not in HF_EXPERT_TENSORS:
        raise KeyError(f"{leaf!r} is not an mxfp4 expert tensor (known: "
                       f"{', '.join(HF_EXPERT_TENSORS)})")
    return HF_EXPERT_TENSORS[leaf], gate_up_rows(tensor) if leaf.startswith("gate_up") else tensor
