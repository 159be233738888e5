"""A dense product for the few rows of a decode step (Triton), the `linear` layer op.

Why: at batch 1 cuBLAS streams the small projections of a MoE model (Qwen3-30B-A3B's qkv
2048 -> 5120, o 4096 -> 2048 and the 128-expert router) at 1.9-2.7 TB/s and the router at a
tenth of that (two thread blocks for 128 outputs), against ~4.2 TB/s of copy bandwidth. Here
each program streams a [BLOCK_N, BLOCK_K] tile of W per step and multiplies it by the (at most
SMALL_M) rows of x, accumulating products in fp32 and reducing over K once at the end; K is split
over several programs when the outputs alone give too few of them, and the last program of a
tile (an atomic count per tile, reset by that program) sums the splits in order, so the result is
deterministic and no second launch is needed. Bias is added in fp32 before the one rounding.

Only where it pays: rows <= SMALL_M and weights of at most MAX_BYTES (larger ones stream well in
cuBLAS); the op falls back to F.linear elsewhere. Tiles are data (TILES), chosen by
bench/sweep_gemv.py on an H200.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from plugins._kit.splitk import LockTable

# Rows the kernel takes: batch-1 decode only for now. The kernel handles up to 4 (a row block
# of 2 or 4, K steps shortened to match), but only one row was measured against cuBLAS.
SMALL_M = 1
# Weights up to this size take the kernel: cuBLAS streams the big ones about as well or better
# (H200 sweep, 2026-12-02: Llama-8B gate_up 235 MB x1.02, down 117 MB x0.95; qkv 50 MB x1.12).
MAX_BYTES = 64 << 20
# (BLOCK_N, BLOCK_K, num_warps, programs per SM the K split aims at). sm90: best or within 1%
# of the best of 36 tiles at every decode shape of bench/sweep_gemv.py (H200, 2026-12-02).
TILES = {"sm90": (8, 512, 4, 4), "default": (8, 512, 4, 4)}


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, stride_xm,
                    stride_wn, stride_ym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(steps, SPLIT_K)
        k_lo = split * per_split * BLOCK_K
        k_hi = tl.minimum(K, k_lo + per_split * BLOCK_K)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            else:
                k_ok = k0 + rk < K
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        mask = m_ok[:, None] & n_ok[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K > 1:
            tile = rm[:, None] * N + rn[None, :]
            tl.store(part_ptr + split * BLOCK_M * N + tile, out, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the count moves
            done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):  # in split order: deterministic
                    out += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                if HAS_BIAS:
                    out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next call (graph replays)
        else:
            if HAS_BIAS:
                out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    class K:
        pass

    k = K()
    k.triton = triton
    k.gemv = gemv_kernel
    return k


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small number still exercises the K split
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=16)
def _arch(device: torch.device) -> str:
    if device.type == "cuda" and not torch.version.hip:
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 9:
            return "sm90"
    return "default"


def config(n: int, k: int, device: torch.device, tiles: tuple | None = None) -> dict:
    """Launch parameters for an [n, k] weight: the arch's tile, K split until the programs
    reach the aimed-at count per SM (each split keeping at least two K steps)."""
    block_n, block_k, warps, per_sm = tiles or TILES[_arch(device)]
    n_tiles = -(-n // block_n)
    steps = -(-k // block_k)
    split = 1
    while n_tiles * split * 2 <= per_sm * _sm_count(device) and split * 2 <= steps // 2 \
            and split < 32:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": warps}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         cfg: dict | None = None) -> torch.Tensor:
    """x [M <= SMALL_M, K] (last dim contiguous) @ weight [N, K].T (+ bias) -> [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = dict(cfg or config(n, k, x.device))
    split = cfg.pop("SPLIT_K")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    kern = _kernel()
    block_m = max(1, kern.triton.next_power_of_2(m))
    # the products are held [rows, BLOCK_N, BLOCK_K]: more rows, shorter K steps
    cfg["BLOCK_K"] = max(32, cfg["BLOCK_K"] // block_m)
    tiles = kern.triton.cdiv(n, cfg["BLOCK_N"])
    part = (torch.empty((split, block_m, n), dtype=torch.float32, device=x.device)
            if split > 1 else y)
    locks = LockTable.get(x.device, tiles) if split > 1 else y
    kern.gemv[(tiles, split)](
        x, weight, bias if bias is not None else y, y, part, locks, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=block_m, SPLIT_K=split, **cfg)
    return y


def takes(weight: torch.Tensor) -> bool:
    """The kernel serves this weight (else the op is F.linear alone)."""
    return (weight.dim() == 2 and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.stride(1) == 1 and weight.numel() * weight.element_size() <= MAX_BYTES)


def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """f(x [..., K]) -> [..., N]: the kernel for up to SMALL_M rows, F.linear for more."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_M and x.stride(-1) == 1 \
                and x.dtype == weight.dtype:
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    return run
