"""Triton kernels shared by the fp8 and int8 W8A8 methods (imported only on a GPU, or under
TRITON_INTERPRET=1 in the CPU tests, where fp16/fp32 stand in for the 8-bit operands).

- `quantize_acts`: x [M, K] -> (8-bit x, fp32 scales) in one launch: per row (token) or per
  `group` consecutive inputs of a row; scale = amax / qmax (amax clamped to `ub` if given).
- `scaled_mm`: y = (x_q * s_x) @ (w_q * s_w)^T for any M, scales per row / per `group_k`
  inputs of x and per `group_n` x `group_k` block (or per row: group_k = K) of W; each K step
  stays inside one scale block and is scaled once, accumulated in fp32.
- `small_m_linear`: y = x @ W^T for M <= 16 (decode) in one launch, the activation quantization
  fused in: per-token scales from a first pass over the row (one wide load of it), per-group
  scales per K step, or a static scale; weights per output channel or per block. One program
  per BLOCK_N outputs and slice of K, every program streams its weight rows once; from 2 rows
  a 16-row tl.dot tile pads M (the loads are masked); one row takes an FMA kernel without
  tensor cores (the same quantized x, dequantized in registers, fp32 products).

Rounding: fp8 by the hardware conversion (round to nearest even), int8 half away from zero after
clamping (torch.round rounds ties to even: ties are rare and one step apart). Scales (amax /
qmax) and their reciprocals are IEEE-rounded divisions (tl.math.div_rn), and x is quantized as
x * (1 / scale), as core.contract.quant.reciprocal defines it for every path: Triton's `/` on fp32 is
approximate, and fp16 / bf16 inputs put x / scale exactly on a rounding midpoint of the 8-bit
grid often enough that the last ulp decides codes (the quant suite's MoE-experts case, bench/
diag_moe_fp8.py); an exact division per element made the small-M kernel 2-3x slower.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins._kit.splitk import LockTable
from plugins._kit.tiles import grouped_tile, split_for, split_k_range, store_row_split

FP8_MAX = 448.0


@triton.jit
def _quantize(v, QMAX: tl.constexpr, IS_INT: tl.constexpr, out_ty: tl.constexpr):
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_INT:
        v = tl.where(v >= 0, v + 0.5, v - 0.5)
    return v.to(out_ty)


@triton.jit
def _recip(s):
    """1 / s, correctly rounded (core.contract.quant.reciprocal)."""
    return tl.math.div_rn(s * 0.0 + 1.0, s)  # s * 0 + 1: a 1.0 of any shape


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, ub_ptr, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr,
                      IS_INT: tl.constexpr, HAS_UB: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    out_ty = q_ptr.dtype.element_ty
    if GROUP > 0:  # one program per (row, group): amax and quantize in one pass
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, GROUP)
        ok = offs < K
        v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12), QMAX)
        tl.store(q_row + offs, _quantize(v * _recip(scale), QMAX, IS_INT, out_ty), mask=ok)
        tl.store(s_ptr + row * stride_sm + g, scale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        top = tl.maximum(tl.max(amax, axis=0), 1e-12)
        if HAS_UB:
            top = tl.minimum(top, tl.load(ub_ptr))
        scale = tl.math.div_rn(top, QMAX)
        inv = _recip(scale)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + offs, _quantize(v * inv, QMAX, IS_INT, out_ty), mask=offs < K)
        tl.store(s_ptr + row * stride_sm, scale)


def quantize_acts(x: torch.Tensor, qdtype: torch.dtype, group: int = 0,
                  ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] qdtype, fp32 scales [M, 1] or [M, ceil(K/group)])."""
    m, k = x.shape
    is_int = not qdtype.is_floating_point
    qmax = 127.0 if is_int else FP8_MAX
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    groups = triton.cdiv(k, group) if group else 1
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m, groups)](x, q, s, ub if ub is not None else s, k, x.stride(0),
                                       q.stride(0), s.stride(0), GROUP=group, BLOCK=1024,
                                       QMAX=qmax, IS_INT=is_int, HAS_UB=ub is not None)
    return q, s


@triton.jit
def _row_amax(x_row, K, PRO_R: tl.constexpr, PRO_K: tl.constexpr):
    """max |x| over a row of K <= PRO_R * PRO_K inputs, read as one [PRO_R, PRO_K] tile (every
    load in flight at once; max is exact in the input dtype)."""
    offs = tl.arange(0, PRO_R)[:, None] * PRO_K + tl.arange(0, PRO_K)[None, :]
    v = tl.load(x_row + offs, mask=offs < K, other=0.0)
    return tl.max(tl.max(tl.abs(v), axis=1), axis=0).to(tl.float32)


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, xs_ptr, ub_ptr, part_ptr, lock_ptr,
                    M, N, K, stride_xm, stride_wn, stride_ym, stride_wsn, stride_wsk,
                    ACT: tl.constexpr, BLOCKED_W: tl.constexpr, GROUP_N: tl.constexpr,
                    QMAX: tl.constexpr, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_UB: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO_R: tl.constexpr,
                    PRO_K: tl.constexpr):
    # ACT: 0 per-token dynamic, 1 per-group (BLOCK_K inputs) dynamic, 2 static (xs_ptr: []),
    # 3 per-token already quantized (x_ptr: the 8-bit x, xs_ptr: its scales [M, 1]).
    # Program (n, s) computes outputs n*BLOCK_N.. over the s-th of SPLIT_K slices of K; with
    # SPLIT_K > 1 it stores its scaled partial, and the last program of the tile to finish
    # (a counter per tile, reset after) sums the partials in slice order: deterministic.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    q_ty = w_ptr.dtype.element_ty
    x_rows = x_ptr + rm[:, None] * stride_xm
    if ACT == 0:  # the row's amax first, each row in one wide load (no serial chain)
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for r in range(0, M):
            amax = tl.where(rm == r, _row_amax(x_ptr + r * stride_xm, K, PRO_R, PRO_K), amax)
        amax = tl.maximum(amax, 1e-12)
        if HAS_UB:
            amax = tl.minimum(amax, tl.load(ub_ptr))
        xs = tl.math.div_rn(amax, QMAX)
    elif ACT == 2:
        xs = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr)
    elif ACT == 3:
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=1.0)
    else:
        xs = tl.zeros((BLOCK_M,), dtype=tl.float32) + 1.0
    inv = _recip(xs)
    k_lo, k_hi = split_k_range(K, split, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_tile = w_ptr + rn[None, :] * stride_wn + rk[:, None]
    for start in range(k_lo, k_hi, BLOCK_K):
        k_ok = start + rk < K
        if ACT == 3:
            xq = tl.load(x_rows + start + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
        else:
            v = tl.load(x_rows + start + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if ACT == 1:
                xs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12), QMAX)
                inv = _recip(xs)
            xq = _quantize(v * inv[:, None], QMAX, IS_INT, q_ty)
        w = tl.load(w_tile + start, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        part = tl.dot(xq, w).to(tl.float32)
        if BLOCKED_W:
            wsc = tl.load(ws_ptr + (rn // GROUP_N) * stride_wsn + (start // BLOCK_K) * stride_wsk,
                          mask=n_ok, other=0.0)
            acc += part * xs[:, None] * wsc[None, :]
        elif ACT == 1:
            acc += part * xs[:, None]
        else:
            acc += part
    if not BLOCKED_W:
        wsc = tl.load(ws_ptr + rn * stride_wsn, mask=n_ok, other=0.0)
        if ACT == 1:
            acc = acc * wsc[None, :]
        else:
            acc = acc * xs[:, None] * wsc[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    tile = rm[:, None] * N + rn[None, :]
    if SPLIT_K > 1:
        tl.store(part_ptr + split * BLOCK_M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count moves
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next call (graph replays too)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _gemv1_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, xs_ptr, ub_ptr, part_ptr, lock_ptr,
                  N, K, stride_wn, stride_wsn, stride_wsk,
                  ACT: tl.constexpr, BLOCKED_W: tl.constexpr, GROUP_N: tl.constexpr,
                  QMAX: tl.constexpr, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_UB: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRO_R: tl.constexpr, PRO_K: tl.constexpr):
    # One row (batch-1 decode) without tensor cores: x quantized in registers as the M <= 16
    # kernel does, then (dequantized, in fp32) multiplied into a [BLOCK_N, BLOCK_K] accumulator
    # by plain FMAs; one reduction over K at the end. Block scales (BLOCK_N inside one
    # GROUP_N rows, BLOCK_K = the block's K) and per-group activation scales are one number
    # per step, folded into x. Split-K as _small_m_kernel.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    q_ty = w_ptr.dtype.element_ty
    if ACT == 0:
        top = tl.maximum(_row_amax(x_ptr, K, PRO_R, PRO_K), 1e-12)
        if HAS_UB:
            top = tl.minimum(top, tl.load(ub_ptr))
        xs = tl.math.div_rn(top, QMAX)
    elif ACT == 2:
        xs = tl.load(xs_ptr).to(tl.float32)
    if ACT != 1:
        inv = _recip(xs)
    k_lo, k_hi = split_k_range(K, split, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None] * stride_wn
    for start in range(k_lo, k_hi, BLOCK_K):
        k_ok = start + rk < K
        v = tl.load(x_ptr + start + rk, mask=k_ok, other=0.0).to(tl.float32)
        if ACT == 1:
            gs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12), QMAX)
            xq = _quantize(v * _recip(gs), QMAX, IS_INT, q_ty).to(tl.float32)
            if BLOCKED_W:
                wsc = tl.load(ws_ptr + ((pid * BLOCK_N) // GROUP_N) * stride_wsn
                              + (start // BLOCK_K) * stride_wsk)
                xq = xq * (gs * wsc)
            else:
                xq = xq * gs
        else:
            xq = _quantize(v * inv, QMAX, IS_INT, q_ty).to(tl.float32)
        w = tl.load(w_rows + start + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * xq[None, :]
    out = tl.sum(acc, axis=1)
    if not BLOCKED_W:
        out = out * tl.load(ws_ptr + rn * stride_wsn, mask=n_ok, other=0.0)
        if ACT != 1:
            out = out * xs
    store_row_split(out, y_ptr, bias_ptr, part_ptr, lock_ptr, pid, split, rn, n_ok, N,
                    HAS_BIAS, SPLIT_K)


SMALL_M = 16
# From this many rows the per-token dynamic case quantizes x in a launch of its own before the
# small-M kernel (ACT 3), which otherwise reads every row's amax one row after another in each
# program: at M = 16 that prologue made the kernel 2.4x its M = 1 time, and cuBLAS's
# _scaled_mm (with its own quantize launch) beat it at all four Llama-8B shapes (bench/
# sweep_quant.py --only peers, H200, 2026-12-02). Below it the fused prologue is the cheaper.
PREQUANT_ROWS = 4
PER_ROW = 1 << 30  # scaled_mm's group_k for one scale per row


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number exercises the split
    return torch.cuda.get_device_properties(device).multi_processor_count


def _small_m_config(n: int, k: int, block_k: int, device: torch.device) -> dict:
    """Decode tiles (bench/sweep_quant.py on an H200, bench/RESULTS.md): 64 outputs per
    program, K split so that up to four programs per SM stream weights (N = 4096 alone gives 64
    programs for 132 SMs), three stages."""
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while tiles * split * 2 <= 4 * _sm_count(device) and split * 2 <= max(1, steps // 4) \
            and split < 16:
        split *= 2
    return dict(BLOCK_N=block_n, SPLIT_K=split, num_warps=4, num_stages=3)


# Decode kernels and their tiles (bench/sweep_quant.py --only gemv on an H200, L2-cold, 2026-12-02,
# bench/RESULTS.md): which kernel takes M = 1 ("gemv": _gemv1_kernel, "dot": _small_m_kernel)
# per weight form, and the one-row kernel's outputs per program, K per step (block weights: the
# block's K), warps, and programs per multiprocessor its K split aims at. Per channel the
# 16-row dot kernel (with the one-load amax) won at qkv / o / down (12.0 / 10.1 / 22.8 us
# against 13.7 / 11.0 / 24.6) and tied at gate_up; block-wise the one-row kernel at 64 outputs
# won at o / gate_up / down (10.3 / 47.3 / 26.0 us against 11.2 / 50.5 / 26.5).
ONE_ROW_KERNEL = {"channel": "dot", "block": "gemv"}
GEMV_TILES = {"channel": dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, per_sm=8),
              "block": dict(BLOCK_N=64, num_warps=4, per_sm=4)}


def _prologue_tile(k: int) -> dict:
    """A [PRO_R, PRO_K] tile covering a row of K inputs (one load for the per-token amax)."""
    pro_k = min(1024, triton.next_power_of_2(k))
    return dict(PRO_R=triton.next_power_of_2(triton.cdiv(k, pro_k)), PRO_K=pro_k)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, act: str, block: tuple[int, int] | None = None,
                   input_scale: torch.Tensor | None = None, ub: torch.Tensor | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, K] compute dtype -> [M, N]. act: "token" | "group" | "static";
    weight_scale [N, 1] (per channel) or [N/bn, K/bk] with `block` (then act is "group" and
    the K tile is the block's K). `config` (the sweep's): "kernel" ("gemv" for M = 1 only,
    "dot"), "prequant" (per token: quantize x in a launch of its own, PREQUANT_ROWS) and that
    kernel's tiles."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_M:
        raise ValueError(f"small_m_linear takes at most {SMALL_M} rows, got {m}")
    cfg = dict(config or {})
    prequant = cfg.pop("prequant", m >= PREQUANT_ROWS)
    form = "block" if block else "channel"
    kernel = cfg.pop("kernel", None) or (ONE_ROW_KERNEL[form] if m == 1 else "dot")
    if kernel == "gemv" and m == 1:
        tiles = dict(GEMV_TILES[form], **cfg)
        if not block or block[0] % tiles["BLOCK_N"] == 0:
            return _gemv1(x, weight, weight_scale, bias, act, block, input_scale, ub, tiles)
        cfg = {}  # a tile across two weight blocks: the dot kernel's defaults
    is_int = not weight.dtype.is_floating_point
    block_k = cfg.get("BLOCK_K", block[1] if block else 128)
    if block and block_k != block[1]:
        raise ValueError("the K tile must be the weight's K block")
    cfg = dict(cfg or _small_m_config(n, k, block_k, x.device))
    cfg.pop("BLOCK_K", None)
    split = cfg.pop("SPLIT_K", 1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    part = (torch.empty((split, 16, n), dtype=torch.float32, device=x.device) if split > 1
            else y)
    locks = LockTable.get(x.device, tiles) if split > 1 else y
    act_code = {"token": 0, "group": 1, "static": 2}[act]
    if act == "token" and prequant:
        # the rows' amax would be a serial chain of M row reads in every program: one
        # quantize launch first instead
        x, input_scale = quantize_acts(x, weight.dtype, ub=ub)
        act_code, ub = 3, None
    _small_m_kernel[(tiles, split)](
        x, weight, weight_scale, y, bias if bias is not None else y,
        input_scale if input_scale is not None else weight_scale,
        ub if ub is not None else weight_scale, part, locks, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), weight_scale.stride(0),
        weight_scale.stride(1) if weight_scale.dim() > 1 else 0,
        ACT=act_code, BLOCKED_W=block is not None, GROUP_N=block[0] if block else 1,
        QMAX=127.0 if is_int else FP8_MAX, IS_INT=is_int, HAS_BIAS=bias is not None,
        HAS_UB=ub is not None, SPLIT_K=split, BLOCK_M=16, BLOCK_K=block_k,
        **_prologue_tile(k), **cfg)
    return y


def _gemv1(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, act: str, block: tuple[int, int] | None,
           input_scale: torch.Tensor | None, ub: torch.Tensor | None, tiles: dict
           ) -> torch.Tensor:
    """One row through _gemv1_kernel (see small_m_linear)."""
    k = x.shape[1]
    n = weight.shape[0]
    tiles = dict(tiles)
    block_k = block[1] if block else tiles.pop("BLOCK_K")
    tiles.pop("BLOCK_K", None)
    per_sm = tiles.pop("per_sm")
    grid_n = triton.cdiv(n, tiles["BLOCK_N"])
    split = tiles.pop("SPLIT_K", None) or split_for(grid_n, triton.cdiv(k, block_k),
                                                     per_sm * _sm_count(x.device))
    is_int = not weight.dtype.is_floating_point
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else y
    locks = LockTable.get(x.device, grid_n) if split > 1 else y
    _gemv1_kernel[(grid_n, split)](
        x, weight, weight_scale, y, bias if bias is not None else y,
        input_scale if input_scale is not None else weight_scale,
        ub if ub is not None else weight_scale, part, locks, n, k, weight.stride(0),
        weight_scale.stride(0), weight_scale.stride(1) if weight_scale.dim() > 1 else 0,
        ACT={"token": 0, "group": 1, "static": 2}[act], BLOCKED_W=block is not None,
        GROUP_N=block[0] if block else 1, QMAX=127.0 if is_int else FP8_MAX, IS_INT=is_int,
        HAS_BIAS=bias is not None, HAS_UB=ub is not None, SPLIT_K=split, BLOCK_K=block_k,
        **_prologue_tile(k), **tiles)
    return y


@triton.jit
def _block_scaled_mm(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                     stride_asm, stride_ask, stride_bsn, stride_bsk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PER_ROW_SCALES: tl.constexpr, ACC_INT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None] * stride_bk
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // GROUP_N) * stride_bsn

    if ACC_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & (rk[:, None] < k_left), other=0.0)
        if PER_ROW_SCALES:  # one scale per row of each: accumulate plain, scale once below
            acc += tl.dot(a, b)
        else:
            kb = (step * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b).to(tl.float32) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if PER_ROW_SCALES:
        a_s = tl.load(as_ptrs, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs, mask=n_ok, other=0.0)
        acc = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _mm_config(m: int, group_k: int) -> dict:
    """Tiles by the number of rows; BLOCK_K stays inside one scale block."""
    block_k = 128 if group_k % 128 == 0 else group_k
    if m <= 64:
        return dict(BLOCK_M=32 if m > 16 else 16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8,
                    num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8,
                num_stages=3)


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              group_n: int, group_k: int, out_dtype: torch.dtype,
              bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """a [M, K] (a_scale [M, ceil(K/group_k)]) x b [N, K] (b_scale [ceil(N/group_n),
    ceil(K/group_k)]) -> [M, N] out_dtype. group_k >= K: one scale per row of each."""
    m, k = a.shape
    n = b.shape[0]
    if group_k >= k:
        group_k = PER_ROW  # one scale per row: every K step reads scale column 0
    elif group_k % 16 or (group_k > 128 and group_k % 128):
        raise ValueError(f"K scale group {group_k}: a multiple of 16 (of 128 above 128)")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    cfg = dict(config or _mm_config(m, 128 if group_k == PER_ROW else group_k))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_scaled_mm[grid](
        a, b, c, a_scale, b_scale, bias if bias is not None else c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1) if a_scale.dim() > 1 else 0,
        b_scale.stride(0), b_scale.stride(1) if b_scale.dim() > 1 else 0,
        GROUP_N=group_n, GROUP_K=group_k, HAS_BIAS=bias is not None,
        PER_ROW_SCALES=group_k == PER_ROW and group_n == 1,
        ACC_INT=group_k == PER_ROW and group_n == 1 and not a.dtype.is_floating_point, **cfg)
    return c
