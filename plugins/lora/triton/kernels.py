"""The Triton kernels of the `triton` LoRA backend (imported only when it is built).

Both kernels walk a block table: block i is tokens [start[i], start[i] + length[i]) of one
adapter slot slot[i] (length at most BLOCK_M; slot -1: nothing to do, every access masked off).
Prefill steps get one block per BLOCK_M tokens of each adapter segment; decode steps one block
per token (length 1), built on the device (backend.py).

- shrink_kernel: xa[s, t, j*R + r] = sum_k x[t, k] * A[slot, j*R + r, k] over split s's range
  of k (grid axis 2: K cut into splits of K_PER_SPLIT, so a decode token's product of a few
  hundred KB of A runs on as many programs, not one loop over all of K), for every row j*R + r
  of A (all slices' ranks at once: one GEMM [M, K] x [K, n_slices * R]), fp32 into xa;
- expand_kernel: y[t, off_j + n] += scale[slot] * sum_r (sum_s xa[s, t, j*R + r]) *
  B[slot, off_j + n, r] (the splits summed in a fixed order: deterministic, no atomics),
  grid axis 1 the output slice j (at most 3, their widths W0, W1, W2 as scalars), axis 2 column
  tiles of the slice: every element of y is read and written by exactly one program (no atomics;
  tokens of base-only segments are never touched).
Rows of A beyond a slot's rank are zero in the buffers, so the kernels take the full R.
xa is rounded to the compute dtype before the expand dot (fp32 stays fp32, with IEEE dots).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def shrink_kernel(x_ptr, a_ptr, xa_ptr, blk_start, blk_len, blk_slot, K, NR, K_PER_SPLIT,
                  stride_xt, stride_as, stride_ar, stride_xas, stride_xat,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot = tl.load(blk_slot + pid_b)
    start = tl.load(blk_start + pid_b).to(tl.int64)
    n_rows = tl.where(slot >= 0, tl.load(blk_len + pid_b), 0)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < n_rows
    mask_n = rn < NR
    x_rows = x_ptr + (start + rm)[:, None] * stride_xt
    a_rows = a_ptr + slot64 * stride_as + rn[None, :].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * K_PER_SPLIT  # a multiple of BLOCK_K
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_PER_SPLIT), BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        xt = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_rows + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)  # [BM, BK] x [BK, BN]
    tl.store(xa_ptr + pid_s.to(tl.int64) * stride_xas + (start + rm)[:, None] * stride_xat
             + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def expand_kernel(xa_ptr, b_ptr, y_ptr, scale_ptr, W0, W1, W2, blk_start, blk_len, blk_slot, R,
                  SPLITS, stride_xas, stride_xat, stride_bs, stride_bo, stride_yt,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid_b = tl.program_id(0)
    j = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(blk_slot + pid_b)
    start = tl.load(blk_start + pid_b).to(tl.int64)
    n_rows = tl.where(slot >= 0, tl.load(blk_len + pid_b), 0)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    # slice j of at most 3 (fused q/k/v): its column offset in y and in B, and its width
    off = tl.where(j == 0, 0, tl.where(j == 1, W0, W0 + W1))
    width = tl.where(j == 0, W0, tl.where(j == 1, W1, W2))
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    mask_m = rm < n_rows
    mask_n = rn < width
    mask_r = rr < R
    xa_ptrs = xa_ptr + (start + rm)[:, None] * stride_xat + (j * R + rr)[None, :]
    mask_xa = mask_m[:, None] & mask_r[None, :]
    xa = tl.load(xa_ptrs, mask=mask_xa, other=0.0)
    for s in range(1, SPLITS):  # the shrink's K splits, in order
        xa += tl.load(xa_ptrs + s * stride_xas, mask=mask_xa, other=0.0)
    bt = tl.load(b_ptr + slot64 * stride_bs + (off + rn)[None, :].to(tl.int64) * stride_bo
                 + rr[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    delta = tl.dot(xa.to(bt.dtype), bt, input_precision=PRECISION)  # [BM, BR] x [BR, BN]
    delta = delta * tl.load(scale_ptr + slot64)
    y_ptrs = y_ptr + (start + rm)[:, None] * stride_yt + (off + rn)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
