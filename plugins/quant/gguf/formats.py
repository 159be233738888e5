"""GGUF's integer block formats -> the kernels' two block formats, exactly.

Every supported GGML type is `w = scale * code + min` per block once its sub-block scales are
unpacked, so one matrix becomes (kernels.c's header):
- `bits` 4: codes 0..15, two per byte, ggml's order in a block of 32; blocks of 32;
- `bits` 8: codes 0..255 one per byte; blocks of 32, or 16 for Q6_K's sub-blocks;
with per-block `scales` and `mins` in fp16 where the file's values are fp16 times a power of two
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and fp32 where they are products (the K-quants).

| GGML type | bits | block | scale / min |
|---|---|---|---|
| Q4_0 | 4 | 32 | d, -8d (fp16) |
| Q4_1 | 4 | 32 | d, m (fp16) |
| Q5_0 / Q5_1 | 8 | 32 | d, -16d / m (fp16) |
| Q8_0 | 8 | 32 | d, -128d (fp16); code = q + 128 |
| Q4_K | 4 | 32 | d*sc, -dmin*m (fp32) |
| Q5_K | 8 | 32 | d*sc, -dmin*m (fp32) |
| Q6_K | 8 | 16 | d*sc, -32*d*sc (fp32) |

The byte layouts are ggml's (ggml-common.h); tests check every type against the `gguf`
package's own dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SUPPORTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# elements and bytes per GGML block
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
         "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass
class Packed:
    """One [N, K] matrix in a kernel block format (torch tensors on the CPU)."""

    codes: torch.Tensor  # uint8 [N, K // 2] (bits 4) or [N, K] (bits 8)
    scales: torch.Tensor  # float16 / float32 [N, K // bs]
    mins: torch.Tensor  # same shape and dtype
    bits: int
    bs: int
    types: tuple[str, ...]  # the GGML type(s) it came from

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.bs

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))


def _times(d: np.ndarray, power_of_two: int) -> np.ndarray:
    """fp16 d * a power of two, exact (or inf past fp16's range, as fp16 arithmetic gives),
    through fp32: numpy's fp16 arithmetic is emulated and ~10x slower."""
    with np.errstate(over="ignore"):
        return (d.astype(np.float32) * np.float32(power_of_two)).astype(np.float16)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block: [rows, blocks] float16."""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """codes [..., 32] (0..15) -> [..., 16] bytes: element j low, element j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit (scale, min) pairs -> two [..., 8] arrays."""
    s = sc12.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def from_ggml(type_name: str, raw: np.ndarray, k: int) -> Packed:
    """raw bytes [N, row_bytes] of GGML type `type_name` holding rows of k elements -> Packed."""
    if type_name not in BLOCK:
        raise ValueError(f"GGML type {type_name} has no kernel here (supported: "
                         f"{', '.join(SUPPORTED)})")
    qk, size = BLOCK[type_name]
    n = raw.shape[0]
    if k % qk or raw.shape[-1] != k // qk * size:
        raise ValueError(f"{type_name}: {raw.shape[-1]} bytes per row do not hold {k} elements")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // qk, size)
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        m = _f16(b, 2) if type_name == "Q4_1" else _times(d, -8)
        codes = b[..., 4 if type_name == "Q4_1" else 2:].reshape(n, k // 2)
        return _packed(codes, d, m, 4, 32, type_name)
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        off = 4 if type_name == "Q5_1" else 2
        m = _f16(b, 2) if type_name == "Q5_1" else _times(d, -16)
        qh = b[..., off:off + 4].copy().view("<u4")[..., 0]  # [n, blocks]
        ql = b[..., off + 4:]
        bit = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [n, blocks, 32]
        q = np.concatenate([ql & 0xF, ql >> 4], axis=-1) | (bit.astype(np.uint8) << 4)
        return _packed(q.reshape(n, k), d, m, 8, 32, type_name)
    if type_name == "Q8_0":
        d = _f16(b, 0)
        q = b[..., 2:] ^ np.uint8(0x80)  # int8 x -> uint8 x + 128: the sign bit flipped
        return _packed(q.reshape(n, k), d, _times(d, -128), 8, 32, type_name)
    if type_name in ("Q4_K", "Q5_K"):
        d = _f16(b, 0).astype(np.float32)
        dmin = _f16(b, 2).astype(np.float32)
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: 2 sub-blocks each
        q = np.stack([qs & 0xF, qs >> 4], axis=3)  # [n, blocks, chunk, lo/hi, 32]
        if type_name == "Q5_K":
            qh = b[..., 16:48]  # bit 2c of qh[l]: chunk c's low sub-block, 2c + 1: high
            sub = np.arange(8).reshape(4, 2)
            hb = (qh[..., None, None, :] >> sub[..., None].astype(np.uint8)) & 1
            q = q | (hb << 4)
        q = q.reshape(n, -1, 8, 32)
        scales = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
        mins = (-(dmin[..., None] * mn.astype(np.float32))).reshape(n, -1)
        if type_name == "Q4_K":
            return _packed(_pack_nibbles(q).reshape(n, k // 2), scales, mins, 4, 32, type_name)
        return _packed(q.reshape(n, k), scales, mins, 8, 32, type_name)
    # Q6_K: ql[128], qh[64], scales[16] int8, d fp16; 16 sub-blocks of 16
    ql = b[..., 0:128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208).astype(np.float32)
    lo = ql[..., :32], ql[..., 32:]
    q = np.stack([(lo[0] & 0xF) | ((qh & 3) << 4), (lo[1] & 0xF) | (((qh >> 2) & 3) << 4),
                  (lo[0] >> 4) | (((qh >> 4) & 3) << 4), (lo[1] >> 4) | (((qh >> 6) & 3) << 4)],
                 axis=3)  # [n, blocks, half, quarter, 32]: elements in order
    scales = (d[..., None] * sc).reshape(n, -1)
    return _packed(q.reshape(n, k), scales, scales * np.float32(-32), 8, 16, type_name)


def _packed(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, bits: int, bs: int,
            type_name: str) -> Packed:
    n = codes.shape[0]
    return Packed(torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
                  torch.from_numpy(np.ascontiguousarray(scales).reshape(n, -1)),
                  torch.from_numpy(np.ascontiguousarray(mins).reshape(n, -1)),
                  bits, bs, (type_name,))


def widen(p: Packed, bits: int, bs: int, scale_dtype: torch.dtype) -> Packed:
    """The same matrix in a wider form (4 -> 8 bits, blocks 32 -> 16, fp16 -> fp32 scales):
    exact, for stacking shards of different types into one matrix."""
    codes, scales, mins = p.codes, p.scales, p.mins
    if bits == 8 and p.bits == 4:
        n = codes.shape[0]
        c = codes.reshape(n, -1, 16)
        codes = torch.cat([c & 0xF, c >> 4], dim=-1).reshape(n, -1)
    if bs == 16 and p.bs == 32:
        scales, mins = scales.repeat_interleave(2, dim=1), mins.repeat_interleave(2, dim=1)
    return Packed(codes, scales.to(scale_dtype), mins.to(scale_dtype), bits, bs, p.types)


def stack(parts: list[Packed]) -> Packed:
    """Shards [N_i, K] -> one [sum N_i, K] matrix in the widest of their forms."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    bs = min(p.bs for p in parts)
    dt = torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else torch.float16
    w = [widen(p, bits, bs, dt) for p in parts]
    types = tuple(dict.fromkeys(t for p in parts for t in p.types))
    return Packed(torch.cat([p.codes for p in w]), torch.cat([p.scales for p in w]),
                  torch.cat([p.mins for p in w]), bits, bs, types)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes [rows, bytes per row] of GGML type `type_name` whose fp16 scale fields
    (d, and m / dmin where the type has one) are sane values ~N(0, 0.01): test and bench data."""
    rng = np.random.default_rng(seed)
    qk, size = BLOCK[type_name]
    raw = rng.integers(0, 256, (rows, cols // qk, size), dtype=np.uint8)
    halves = (rng.standard_normal((rows, cols // qk, 2)) * 0.01).astype(np.float16)
    h = halves.view(np.uint8).reshape(rows, cols // qk, 4)
    if type_name == "Q6_K":
        raw[..., 208:210] = h[..., :2]  # d is the last field
    else:
        raw[..., :2] = h[..., :2]
        if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # m / dmin
            raw[..., 2:4] = h[..., 2:4]
    return raw.reshape(rows, -1)


def dequantize_ref(p: Packed) -> torch.Tensor:
    """fp32 [N, K] from a Packed matrix in torch (the kernels' own dequant is kernels.c's)."""
    n = p.codes.shape[0]
    if p.bits == 4:
        c = p.codes.reshape(n, -1, 16)
        q = torch.cat([c & 0xF, c >> 4], dim=-1).reshape(n, -1, 32)
    else:
        q = p.codes.reshape(n, -1, p.bs)
    w = q.float() * p.scales.float()[..., None] + p.mins.float()[..., None]
    return w.reshape(n, -1)
