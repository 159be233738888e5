"""Triton GEMM over block-scaled operands: y = (x_q * s_x) @ (w_q * s_w)^T.

x_q [M, K] with one scale per row and `bk` consecutive inputs (s_x [M, ceil(K/bk)]); w_q [N, K]
with one scale per bn x bk block (s_w [ceil(N/bn), ceil(K/bk)]). Each K step of the kernel stays
inside one scale block (BLOCK_K divides bk), so the partial product of a step is scaled once and
accumulated in fp32. Operand dtype is free: e4m3 on the GPU; fp16 under TRITON_INTERPRET=1,
which is how the CPU tests check the indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.quant.common import per_group_fp8


@triton.jit
def _block_scaled_mm(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                     stride_asm, stride_ask, stride_bsn, stride_bsk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * grid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None] * stride_bk
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & (rk[:, None] < k_left), other=0.0)
        kb = (step * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int, bk: int) -> dict:
    """Tiles by the number of rows: decode-sized M streams weights (narrow M, more programs
    along N); prefill-sized M takes square tiles. BLOCK_K stays inside one scale block."""
    block_k = min(128, bk)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                    num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8,
                num_stages=3)


def block_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                    b_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] (a_scale [M, K/bk]) x b [N, K] (b_scale [N/bn, K/bk]) -> [M, N] out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    if bk % 16 or (bk > 128 and bk % 128):
        raise ValueError(f"block {block}: the K block must be a multiple of 16 (and of 128 "
                         "above 128)")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    cfg = _config(m, bk)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_scaled_mm[grid](
        a, b, c, a_scale, b_scale, bias if bias is not None else c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        GROUP_N=bn, GROUP_K=bk, HAS_BIAS=bias is not None, **cfg)
    return c


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] in the compute dtype -> [M, N]: per-token-group e4m3 activations (group = the
    weight's K block), then the block-scaled GEMM."""
    xq, xs = per_group_fp8(x, block[1])
    return block_scaled_mm(xq, xs, weight, weight_scale_inv, block, x.dtype, bias)
