"""Triton helpers shared by the quant plugins' GEMM kernels (int4, and fp8 / int8 through
w8a8_triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_k_range(K, split, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[k_lo, k_hi) of the split-th of SPLIT_K slices of K, in whole BLOCK_K steps (the last
    slice may be short or empty)."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = split * per_split * BLOCK_K
    return k_lo, tl.minimum(K, k_lo + per_split * BLOCK_K)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles run
    side by side over the same weight columns, so those columns are read from L2, not HBM."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * grid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def store_row_split(acc, y_ptr, bias_ptr, part_ptr, lock_ptr, pid, split, rn, n_ok, N,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """The end of a one-row product split over K: program (pid, split) holds the fp32 partial
    `acc` of outputs `rn`. With SPLIT_K > 1 it stores the partial; the last program of the tile
    to finish (a count per tile in lock_ptr, plugins._kit.splitk.LockTable) sums the partials in
    slice order, adds the bias, stores y and resets the count (graph replays): deterministic."""
    if SPLIT_K > 1:
        tl.store(part_ptr + split * N + rn, acc, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the count moves
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(lock_ptr + pid, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def split_for(tiles: int, steps: int, target: int) -> int:
    """K slices for a split-K launch: powers of two up to 32 while the grid stays under
    `target` programs and every slice keeps a K step."""
    split = 1
    while tiles * split * 2 <= target and split * 2 <= steps and split < 32:
        split *= 2
    return split
