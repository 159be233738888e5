"""Triton dequant-GEMM for INT4 weight-only linears: y = x @ W^T with W held as nibbles.

Weights are in the layout of plugins.quant.int4.packing (w_q int32 [K/8, N] packed along K,
scales and zeros [K/group, N]). Each program owns a BLOCK_M x BLOCK_N tile of y and a range of
K (split-K); per K step it loads the BLOCK_K/8 x BLOCK_N int32 words once, shifts the
nibbles out in registers (reshaped to BLOCK_K x BLOCK_N), and multiplies x by (q - z) with
tl.dot in x's dtype (q - z is in -16..15, exact in fp16 / bf16), accumulating in fp32. BLOCK_K
divides the group, so one tile sees one scale per column, applied to the step's product.
Split-K partials go to an fp32 [SPLIT_K, M, N] buffer that torch sums (deterministic).

Decode-sized M (<= 16) takes 16-row tiles and splits K until the grid covers the device's
multiprocessors a few times over: at batch 1 the weight stream is the whole cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.quant.tiles import grouped_tile


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
