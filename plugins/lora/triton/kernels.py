"""The Triton kernels of the `triton` LoRA backend (imported only when it is built).

Both kernels walk a block table: block i is rows [start[i], start[i] + length[i]) of one
adapter slot slot[i] (length at most BLOCK_M; slot -1 or length 0: the program returns at once).
With GATHER a row is a position in the step's tokens sorted by slot, its token perm[row]
(decode steps: blocks.py groups the tokens by slot on the device); without, the row is the
token (prefill: blocks of BLOCK_M tokens of each adapter segment, built on the host). xa is
indexed by row (a block's rows are contiguous in it), x and y by token.

- shrink_kernel: xa[s, row, j*R + r] = sum_k x[t, k] * A[slot, j*R + r, k] over split s's range
  of k (grid axis 2: K cut into splits of K_PER_SPLIT, so a decode token's product of a few
  hundred KB of A runs on as many programs, not one loop over all of K), for every row j*R + r
  of A (all slices' ranks at once: one GEMM [M, K] x [K, n_slices * R]), fp32 into xa;
- expand_kernel: y[t, off_j + n] += scale[slot] * sum_r (sum_s xa[s, row, j*R + r]) *
  B[slot, off_j + n, r] (the splits summed in a fixed order: deterministic, no atomics),
  grid axis 1 the output slice j (at most 3, their widths W0, W1, W2 as scalars), axis 2 column
  tiles of the slice: every element of y is read and written by exactly one program (no atomics:
  a token is in at most one block; tokens of base-only segments are in none and never touched).
Rows of A beyond a slot's rank are zero in the buffers, so the kernels take the full R.
xa is rounded to the compute dtype before the expand dot (fp32 stays fp32, with IEEE dots).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tokens(perm_ptr, start, rm, mask_m, GATHER: tl.constexpr):
    """The tokens of a block's rows start + rm (int64; masked rows: token 0, never accessed)."""
    if GATHER:
        tok = tl.load(perm_ptr + start + rm, mask=mask_m, other=0).to(tl.int64)
    else:
        tok = start + rm
    return tok


@triton.jit
def shrink_kernel(x_ptr, a_ptr, xa_ptr, blk_start, blk_len, blk_slot, perm_ptr, K, NR,
                  K_PER_SPLIT, stride_xt, stride_as, stride_ar, stride_xas, stride_xat,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATHER: tl.constexpr, PRECISION: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    slot = tl.load(blk_slot + pid_b)
    n_rows = tl.where(slot >= 0, tl.load(blk_len + pid_b), 0)
    if n_rows == 0:  # an unused block (decode tables are sized for the worst case)
        return
    start = tl.load(blk_start + pid_b).to(tl.int64)
    slot64 = slot.to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < n_rows
    mask_n = rn < NR
    tok = _tokens(perm_ptr, start, rm, mask_m, GATHER)
    x_rows = x_ptr + tok[:, None] * stride_xt
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
def expand_kernel(xa_ptr, b_ptr, y_ptr, scale_ptr, W0, W1, W2, blk_start, blk_len, blk_slot,
                  perm_ptr, R, SPLITS, stride_xas, stride_xat, stride_bs, stride_bo, stride_yt,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  GATHER: tl.constexpr, PRECISION: tl.constexpr):
    pid_b = tl.program_id(0)
    j = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(blk_slot + pid_b)
    n_rows = tl.where(slot >= 0, tl.load(blk_len + pid_b), 0)
    if n_rows == 0:  # an unused block (decode tables are sized for the worst case)
        return
    start = tl.load(blk_start + pid_b).to(tl.int64)
    slot64 = slot.to(tl.int64)
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
    tok = _tokens(perm_ptr, start, rm, mask_m, GATHER)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + (off + rn)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
