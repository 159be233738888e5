"""Triton dequant-GEMM for INT4 weight-only linears: y = x @ W^T with W held as nibbles.

Weights are in the layout of plugins.quant.int4.packing (w_q int32 [K/8, N] packed along K,
scales and zeros [K/group, N]). Each program owns a BLOCK_M x BLOCK_N tile of y and a range of
K (split-K); per K step it loads the BLOCK_K/8 x BLOCK_N int32 words once, shifts the
nibbles out in registers (reshaped to BLOCK_K x BLOCK_N), and multiplies x by (q - z) with
tl.dot in x's dtype (q - z is in -16..15, exact in fp16 / bf16), accumulating in fp32. BLOCK_K
divides the group, so one tile sees one scale per column, applied to the step's product.
Split-K partials go to an fp32 [SPLIT_K, M, N] buffer that torch sums (deterministic).

Decode-sized M (2..16) takes 16-row tiles and splits K until the grid covers the device's
multiprocessors a few times over: at batch 1 the weight stream is the whole cost.

One row (batch-1 decode) takes `int4_gemv`: no tensor cores (a 16-row tile would waste 15/16 of
them and round-trip the dequantized tile through shared memory), a tl.sum-free inner loop of
FMAs: each thread owns whole K columns of its words (R word rows x 4 adjacent outputs, 16-byte
loads), turns nibble i into the float 2^23 + q by or-ing it into a float's mantissa (one integer
op and a subtraction, no conversion instruction), multiplies it by x[8r + i], and the zero point
is taken out once per group (sum_k x_k (q_k - z) = sum_k x_k q_k - z sum_k x_k). K is split so
that a few programs per multiprocessor stream weights; the last program of a tile sums the
partials in slice order (plugins._kit.splitk.LockTable): one launch, deterministic.

From DEQUANT_ROWS rows (prefill) `int4_dequant` writes W^T in x's dtype in one launch and the
vendor GEMM multiplies: the dequantization is a pass over the weight (0.5 B read, 2 B written per
weight), a few percent of a prefill-sized bf16 GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins._kit.splitk import LockTable
from plugins._kit.tiles import grouped_tile, split_for, split_k_range, store_row_split


@triton.jit
def _int4_gemm(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, K_ITERS_PER_SPLIT,
               stride_xm, stride_xk, stride_wk, stride_wn, stride_sg, stride_sn,
               stride_zg, stride_zn, stride_ys, stride_ym, stride_yn,
               GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               PRECISION: tl.constexpr):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rw8 = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # nibble i of a word: input 8r + i

    k_start = pid_k * K_ITERS_PER_SPLIT * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, K_ITERS_PER_SPLIT):
        k0 = k_start + it * BLOCK_K
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        rw = k0 // 8 + rw8
        words = tl.load(w_ptr + rw[:, None] * stride_wk + rn[None, :] * stride_wn,
                        mask=(rw < K // 8)[:, None] & n_ok[None, :], other=0)
        # [BLOCK_K/8, BLOCK_N] words -> [BLOCK_K/8, 8, BLOCK_N] nibbles -> [BLOCK_K, BLOCK_N]
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        # the last split may step past K (its x is masked to 0): read a group that exists
        g = tl.minimum(k0, K - 1) // GROUP
        s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0)
        z = tl.load(z_ptr + g * stride_zg + rn * stride_zn, mask=n_ok, other=0)
        w = (q - z.to(tl.int32)[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION) * s.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_k_for(group: int, k: int) -> int:
    """The longest K step (<= 128) that divides both the group and K."""
    for bk in (128, 64, 32, 16):
        if group % bk == 0 and k % bk == 0:
            return bk
    raise ValueError(f"group {group} / K {k}: no K step of 16..128 divides both")


def _config(m: int, n: int, k: int, block_k: int, sms: int) -> dict:
    """Tiles by rows: decode streams the weight (narrow M, split K to fill the device);
    prefill takes larger tiles, split only where the grid is too small to fill it."""
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
        block_k = min(block_k, 64)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    iters = k // block_k
    split = 1
    while tiles * split < 2 * sms and split * 2 <= iters and split < 16:
        split *= 2
    return dict(cfg, BLOCK_K=block_k, SPLIT_K=split)


def int4_linear(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int, bias: torch.Tensor | None, sms: int = 1) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) -> [M, N] in x's dtype. `sms`: multiprocessors to fill
    (split-K is chosen from it)."""
    m, k = x.shape
    n = w_q.shape[1]
    if w_q.shape[0] * 8 != k:
        raise ValueError(f"x has K={k}, the weight {w_q.shape[0] * 8}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    cfg = _config(m, n, k, block_k_for(group, k), sms)
    split = cfg.pop("SPLIT_K")
    iters = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split)
    if split == 1:
        y = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    with_bias = bias is not None and split == 1
    _int4_gemm[grid](
        x, w_q, scales, zeros, bias if with_bias else y, y, m, n, k, iters,
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), scales.stride(0),
        scales.stride(1), zeros.stride(0), zeros.stride(1), y.stride(0), y.stride(1),
        y.stride(2), GROUP=group, HAS_BIAS=with_bias,
        PRECISION="ieee" if x.dtype == torch.float32 else None, **cfg)
    if split == 1:
        return y[0]
    out = y.sum(0)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@triton.jit
def _nib(bits, x):
    """(2^23 + bits as a float - 2^23) * x: bits is a nibble in place, n * 16^j, and x comes
    pre-scaled by 16^-j (a power of two, exact), so the product is n * x exactly."""
    return ((bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * x[:, None]


@triton.jit
def _in_place_step(words, x_row, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step of _int4_gemv with IN_PLACE: (the [R, BLOCK_N] nibble-times-x sums, the sum of
    the step's x). Word r holds inputs 8r .. 8r+7, nibble i at bits 4i."""
    xv = tl.load(x_row + tl.arange(0, BLOCK_K)).to(tl.float32)
    even, odd = tl.split(tl.reshape(xv, (R, 4, 2)))          # inputs 8r + 2j, 8r + 2j + 1
    e0, e1 = tl.split(tl.reshape(even, (R, 2, 2)))           # 8r + 4a, 8r + 4a + 2
    o0, o1 = tl.split(tl.reshape(odd, (R, 2, 2)))            # 8r + 4a + 1, 8r + 4a + 3
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    hi = words >> 16  # nibbles 4..7 at bits 0..15 (the sign bits above are masked off)
    t = _nib(words & 0xF, x0)
    t += _nib(words & 0xF0, x1 * 0.0625)
    t += _nib(words & 0xF00, x2 * 0.00390625)
    t += _nib(words & 0xF000, x3 * 0.000244140625)
    t += _nib(hi & 0xF, x4)
    t += _nib(hi & 0xF0, x5 * 0.0625)
    t += _nib(hi & 0xF00, x6 * 0.00390625)
    t += _nib(hi & 0xF000, x7 * 0.000244140625)
    return t, tl.sum(xv, axis=0)


@triton.jit
def _int4_gemv(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, N, K,
               stride_wk, stride_sg, stride_zg, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               IN_PLACE: tl.constexpr = False):
    # Program (n, s): outputs n*BLOCK_N.. over the s-th of SPLIT_K slices of K (BLOCK_K steps,
    # each inside one group). IN_PLACE (the default, GEMV_TILES): the step's x in one load,
    # split into its 8 interleaved vectors, and each nibble masked where it sits instead of
    # shifted down (bench/sass_count.py: 10-15% fewer instructions a step on sm_90, no scalar x
    # loads). Without it: 8 strided x loads a step and each nibble shifted to bit 0.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8  # word rows per step
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    n_ok = rn < N
    k_lo, k_hi = split_k_range(K, split, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        words = tl.load(w_ptr + (start // 8 + rr)[:, None] * stride_wk + rn[None, :],
                        mask=n_ok[None, :], other=0)
        if IN_PLACE:
            t, x_total = _in_place_step(words, x_ptr + start, R, BLOCK_K)
        else:
            t = tl.zeros((R, BLOCK_N), dtype=tl.float32)
            xsum = tl.zeros((R,), dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + start + rr * 8 + i).to(tl.float32)  # inputs 8r + i
                q = ((words >> (4 * i)) & 0xF) | 0x4B000000  # the float 2^23 + nibble
                t += (q.to(tl.float32, bitcast=True) - 8388608.0) * xi[:, None]
                xsum += xi
            x_total = tl.sum(xsum, axis=0)
        g = start // GROUP
        sc = tl.load(s_ptr + g * stride_sg + rn, mask=n_ok, other=0.0).to(tl.float32)
        zp = tl.load(z_ptr + g * stride_zg + rn, mask=n_ok, other=0).to(tl.float32)
        acc += sc * (tl.sum(t, axis=0) - zp * x_total)
    store_row_split(acc, y_ptr, bias_ptr, part_ptr, lock_ptr, pid, split, rn, n_ok, N,
                    HAS_BIAS, SPLIT_K)


# Batch-1 tiles (bench/sweep_quant.py --only int4 on an H200, L2-cold, 2026-12-02,
# bench/RESULTS.md): outputs per program, K per step, warps, and programs per multiprocessor
# the K split aims at. 8 per SM: qkv 11.1 us against 13.3 at 4; the others within 10%. The
# in-place unpack at 4 warps (--only peers, session 13): qkv / o / gate_up / down 10.8 / 8.8 /
# 33.7 / 21.6 us against the shifted unpack at 2 warps' 11.1 / 9.3 / 42.8 / 25.3.
GEMV_TILES = dict(BLOCK_N=256, BLOCK_K=128, num_warps=4, per_sm=8, IN_PLACE=True)


def int4_gemv(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group: int, bias: torch.Tensor | None, sms: int = 1,
              config: dict | None = None) -> torch.Tensor:
    """x [1, K] (fp16 / bf16 / fp32, contiguous) -> [1, N] in x's dtype."""
    m, k = x.shape
    n = w_q.shape[1]
    if m != 1:
        raise ValueError(f"int4_gemv takes one row, got {m}")
    if w_q.shape[0] * 8 != k:
        raise ValueError(f"x has K={k}, the weight {w_q.shape[0] * 8}")
    cfg = dict(GEMV_TILES, **(config or {}))
    block_k = min(cfg.pop("BLOCK_K"), group)
    if group % block_k or k % block_k:
        block_k = block_k_for(group, k)
    per_sm = cfg.pop("per_sm")
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    split = cfg.pop("SPLIT_K", None) or split_for(tiles, k // block_k, per_sm * sms)
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else y
    locks = LockTable.get(x.device, tiles) if split > 1 else y
    _int4_gemv[(tiles, split)](
        x, w_q, scales, zeros, bias if bias is not None else y, y, part, locks, n, k,
        w_q.stride(0), scales.stride(0), zeros.stride(0), GROUP=group,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_K=block_k, **cfg)
    return y


@triton.jit
def _int4_dequant(w_ptr, s_ptr, z_ptr, out_ptr, K, N, stride_wk, stride_sg, stride_zg,
                  stride_ok, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    # Program (r, n): word rows r*BLOCK_R.. (inputs 8x that) of outputs n*BLOCK_N..
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rr < K // 8)[:, None] & (rn < N)[None, :]
    words = tl.load(w_ptr + rr[:, None] * stride_wk + rn[None, :], mask=ok, other=0)
    g = (rr * 8) // GROUP  # a word's 8 inputs sit in one group (the group is a multiple of 8)
    sc = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :], mask=ok, other=0.0)
    zp = tl.load(z_ptr + g[:, None] * stride_zg + rn[None, :], mask=ok, other=0)
    sc = sc.to(tl.float32)
    zp = zp.to(tl.float32)
    for i in tl.static_range(8):
        q = ((words >> (4 * i)) & 0xF).to(tl.float32)
        tl.store(out_ptr + (rr * 8 + i)[:, None] * stride_ok + rn[None, :],
                 ((q - zp) * sc).to(out_ptr.dtype.element_ty), mask=ok)


def int4_dequant(w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The kernels' layout -> W^T [K, N] in `dtype`, in one launch; the same numbers as
    packing.dequantize ((q - z) * s in fp32, then rounded)."""
    k8, n = w_q.shape
    out = torch.empty((k8 * 8, n), dtype=dtype, device=w_q.device)
    block_r, block_n = 16, 128
    _int4_dequant[(triton.cdiv(k8, block_r), triton.cdiv(n, block_n))](
        w_q, scales, zeros, out, k8 * 8, n, w_q.stride(0), scales.stride(0), zeros.stride(0),
        out.stride(0), GROUP=group, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return out


def int4_dequant_linear(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor, group: int, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """x [M, K] -> [M, N]: W^T dequantized to x's dtype by one Triton launch, then cuBLAS."""
    w_t = int4_dequant(w_q, scales, zeros, group, x.dtype)  # [K, N]
    if bias is not None:
        return torch.addmm(bias.to(x.dtype), x, w_t)
    return torch.mm(x, w_t)
