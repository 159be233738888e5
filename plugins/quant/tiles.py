"""Triton helpers shared by the quant plugins' GEMM kernels."""

from __future__ import annotations

import triton
import triton.language as tl


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
