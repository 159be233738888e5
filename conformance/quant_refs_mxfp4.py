"""An independent MXFP4 reference for the quant suite, written from the OCP Microscaling (MX)
spec v1.0, deliberately simple and element by element (numpy + Python scalars), sharing
nothing with any method's vectorized decoder:

- FP4 E2M1 element: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is
  subnormal (0.M x 2^0), otherwise 1.M x 2^(E - 1); no inf or NaN encodings.
- E8M0 scale: 2^(X - 127) for X in 0..254; X = 0xFF is NaN.
- One scale per block of 32 elements; the value is element x scale.
- Checkpoint layout (HF GPT-OSS): `*_blocks` [..., N, K/32, 16] bytes, element 2j of a block
  in the low nibble of byte j, 2j + 1 in the high one; `*_scales` [..., N, K/32].

`quantize` is the spec's suggested conversion (shared exponent floor(log2(amax)) - 2, E2M1's
largest exponent; elements rounded to nearest, ties to even, saturating at 6).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from conformance.quant_refs import RefCase

BLOCK = 32
EMAX_E2M1 = 2  # 6 = 1.5 x 2^2


def _e2m1_from_bits(code: int) -> float:
    sign, exp, man = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = (man / 2.0) if exp == 0 else (1.0 + man / 2.0) * 2.0 ** (exp - 1)
    return -mag if sign else mag  # -0.0 for code 0b1000


E2M1_TABLE = tuple(_e2m1_from_bits(c) for c in range(16))  # the 16-entry table


def decode_scale(x: int) -> float:
    return math.nan if x == 0xFF else float(np.ldexp(1.0, x - 127))


def decode_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [N, G, 16], scales uint8 [N, G] -> float64 [N, 32 G], one element at a
    time: table lookup, then ldexp by the block's exponent (NaN for a 0xFF scale)."""
    n_rows, groups, width = blocks.shape
    assert width == BLOCK // 2 and scales.shape == (n_rows, groups)
    out = np.empty((n_rows, groups * BLOCK), dtype=np.float64)
    for n in range(n_rows):
        for g in range(groups):
            x = int(scales[n, g])
            for j in range(width):
                byte = int(blocks[n, g, j])
                for half, code in enumerate((byte & 0xF, byte >> 4)):
                    v = E2M1_TABLE[code]
                    out[n, g * BLOCK + 2 * j + half] = (math.nan if x == 0xFF
                                                        else np.ldexp(v, x - 127))
    return out


# magnitudes with an even mantissa first, so that argmin's first minimum breaks ties to even
_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_GRID = np.array([E2M1_TABLE[c] for c in _ORDER])


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [N, K] (K a multiple of 32) -> (blocks uint8 [N, K/32, 16], scales uint8
    [N, K/32]) in the checkpoint's layout."""
    n_rows, k = w.shape
    groups = k // BLOCK
    blocks = np.zeros((n_rows, groups, BLOCK // 2), dtype=np.uint8)
    scales = np.zeros((n_rows, groups), dtype=np.uint8)
    for n in range(n_rows):
        for g in range(groups):
            part = w[n, g * BLOCK:(g + 1) * BLOCK].astype(np.float64)
            amax = float(np.abs(part).max())
            shared = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax))
                                                          - EMAX_E2M1))
            scales[n, g] = shared + 127
            x = np.clip(part / 2.0 ** shared, -6.0, 6.0)
            idx = np.abs(np.abs(x)[:, None] - _GRID[None, :]).argmin(axis=1)
            codes = np.array(_ORDER)[idx] | np.where(x < 0, 8, 0)
            blocks[n, g] = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return blocks, scales


def build_expert(w: torch.Tensor, edges: bool = True) -> tuple[dict[str, torch.Tensor],
                                                              torch.Tensor]:
    """One expert projection [N, K] quantized here -> ({"blocks", "scales"} in the checkpoint's
    layout, the weight those bytes mean, fp32 [N, K], by decode_blocks). With `edges`: row 0's
    first block all negative zeros, row 1's first block at scale byte 0 (2^-127), and row 2's
    first code a negative zero amid others, so the method meets them where the checks look."""
    blocks, scales = quantize(w.float().numpy())
    if edges and blocks.shape[0] >= 3:
        blocks[0, 0] = 0x88
        scales[1, 0] = 0
        blocks[2, 0, 0] = (blocks[2, 0, 0] & 0xF0) | 0x8
    deq = decode_blocks(blocks, scales)
    return ({"blocks": torch.from_numpy(blocks), "scales": torch.from_numpy(scales)},
            torch.from_numpy(deq).float())


def _dense(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"weight": w.clone()}, w  # an mxfp4 checkpoint's linears are dense


def moe_edges(make: Callable[..., Any]) -> None:
    """The spec's special scale through a MoE layer of the method's experts: a 0xFF scale byte
    (NaN) in one block of every expert's gate rows makes every output NaN (the block's gate
    value is NaN for every token, and the down product spreads it to every column), where a
    decoder that clamps 0xFF or skips it gives finite values (one that reads it as 2^128 gives
    inf, which the products turn into NaN too: tests/test_mxfp4.py tells those apart bit for
    bit); and a hidden size that is not a multiple of 32 is refused with a ValueError naming
    the 32."""
    def nan_block(expert: int, proj: str, tensors: dict[str, torch.Tensor]) -> None:
        if proj == "gate":
            tensors["scales"][0, 0] = 0xFF

    c = make(64, 64, nan_block)
    with torch.no_grad():
        y = c.moe(c.inputs(5).to(c.device))
    assert torch.isnan(y).all(), f"a 0xFF (NaN) scale gave {int((~torch.isnan(y)).sum())} " \
                                 "non-NaN outputs"
    try:
        make(48, 64, None)
    except ValueError as exc:
        assert "32" in str(exc), f"the refusal does not say why: {exc}"
    else:
        raise AssertionError("a hidden size of 48 (not whole blocks of 32) was accepted")


# GPT-OSS's quantization_config, as its config.json has it
CONFIG = {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"]}


def _cases() -> tuple[RefCase, ...]:
    return (RefCase("mxfp4", "mxfp4", CONFIG, _dense, "none", k_multiple=BLOCK,
                    experts=build_expert, moe_edges=moe_edges),)


CASES = _cases()
