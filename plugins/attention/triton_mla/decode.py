"""Absorbed MLA decode (core.contract.mla), split-KV ("flash-decoding") over the paged latent pool.

Per step: q_lat = q_nope @ w_kc per head (in the compute dtype), then
- stage 1: one program per (block of `block_h` heads, KV split, request) streams its share of the
  request's latent rows once for the whole head block. A row [c | k_rope] (R + Dr values, 576 for
  DeepSeek) is read as two loads, c [R] and k_rope [Dr], each padded to a power of two and masked,
  so the row width itself never has to be one. score = (q_lat . c + q_rope . k_rope) * scaling,
  online softmax in fp32 (exp2), acc += p @ c. It writes the split's o_lat [R] normalised by its
  own sum, and the split's log2-sum-exp. The head block is the fastest grid axis, so the head
  blocks of one request (8 for DeepSeek's 128 heads at 16 a block) run side by side and read the
  same rows at about the same time: the second and later reads hit L2;
- stage 2: the split merge, parallel over the splits, the heads and the latent width: a program
  per (`merge_h` heads, slice of `merge_dv` of the R values, request) weighs `merge_splits`
  splits at a time (all of a request's split sums are read first, for the max and the total). A
  serial loop over one split at a time cost ~1 us a split: 190 us of a 32k-context batch-1 step
  at 256 splits on an H100;
then out = o_lat @ w_vc^T per head. Both per-head products go through `head_matmul`: a Triton
program per head and column block up to HEAD_MATMUL_MAX_ROWS rows a step (off: see
there), torch.bmm past it.

Slots come from req_to_token[req_pool_indices] token by token, so any page size works. Nothing
reads a device value on the host: the grid depends on the batch size, the head count and the
split count (a launch-time constant), which keeps decode capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from core.contract.mla import MLALayerParams, MLAWeights
from plugins._kit.triton_splitkv import (
    LOG2E_F,
    DecodeConfig,
    interpreting,
    num_kv_splits,
    split_range,
)


@dataclass(frozen=True)
class MLADecodeConfig(DecodeConfig):
    """The split-KV tiling and policy, plus MLA's head block and the merge's tiles."""

    block_h: int = 16  # heads a stage-1 program carries (acc: block_h x R fp32)
    merge_splits: int = 64  # splits a merge program weighs per loop iteration
    merge_dv: int = 32  # latent values a merge program covers
    merge_h: int = 4  # heads a merge program covers


# A latent row is wide (R = 512 fp32 accumulators per head): 16 heads a program keep the
# accumulator at 64 registers a thread with 4 warps. (block_n, num_warps, num_stages, waves,
# min_split_tokens, max_splits, block_h, merge tiles): bench/sweep_mla.py's best over DeepSeek's
# shapes on an H200 (2026-12-06: within 3% of each shape's best tiling, geomean; 32 and 64 heads
# a program were slower at every shape). The split policy is the MHA kernel's
# (triton_splitkv.num_kv_splits) with more splits allowed: a batch-1 step has only H / block_h
# programs per split, so a 32k context needs ~128 splits to cover an H100/H200; splits of 32
# tokens keep short contexts from running one program's loop serially.
GPU_CONFIG = MLADecodeConfig(64, 4, 2, 1, 32, 256, 16, 64, 32, 4)
INTERPRET_CONFIG = MLADecodeConfig(16, 1, 1, 1, 16, 8, 16, 4, 64, 4)


def decode_config() -> MLADecodeConfig:
    return INTERPRET_CONFIG if interpreting() else GPU_CONFIG


def head_blocks(num_heads: int, config: MLADecodeConfig | None = None) -> int:
    return triton.cdiv(num_heads, (config or decode_config()).block_h)


def decode_splits(batch_size: int, num_heads: int, device: torch.device,
                  context: int | None = None, config: MLADecodeConfig | None = None) -> int:
    """KV splits for this batch size, head count and longest context (None: unbounded, as for a
    graph that may replay any context)."""
    cfg = config or decode_config()
    return num_kv_splits(batch_size, 1, head_blocks(num_heads, cfg), device, cfg, context)


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _mla_decode_stage1(
    Q_lat, Q_rope, Buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
    qk_scale, num_splits, min_split,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_buf, stride_r2t,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    lo, hi, _ = split_range(seq_len, split, num_splits, 0, min_split, BLOCK_N, False)

    hmask = heads < NUM_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    rmask = offs_r < R
    drmask = offs_dr < DR
    q_lat = tl.load(Q_lat + b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=hmask[:, None] & rmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_rope = tl.load(Q_rope + b * stride_qrb + heads[:, None] * stride_qrh + offs_dr[None, :],
                     mask=hmask[:, None] & drmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_DR]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_r2t
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        rows = Buf + tl.load(table + offs_n, mask=nmask, other=0).to(tl.int64)[:, None] \
            * stride_buf
        # the row's two parts, both requested before either is used
        c = tl.load(rows + offs_r[None, :], mask=nmask[:, None] & rmask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_R]
        kr = tl.load(rows + R + offs_dr[None, :], mask=nmask[:, None] & drmask[None, :],
                     other=0.0)  # [BLOCK_N, BLOCK_DR]
        c = c.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(kr.to(q_rope.dtype)), s, input_precision=PRECISION)
        # qk_scale = scaling * log2(e): scores in log2 units for exp2
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new

    # An empty split stores lse = -inf (stage 2 weighs it by zero and reads only used splits).
    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    tl.store(part_o + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
             + offs_r[None, :], out, mask=hmask[:, None] & rmask[None, :])
    tl.store(part_lse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _mla_merge(
    part_o, part_lse, Out, seq_lens, num_splits, min_split,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, MERGE_H: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    heads = tl.program_id(0) * MERGE_H + tl.arange(0, MERGE_H)
    offs_dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    b = tl.program_id(2)
    hmask = heads < NUM_HEADS
    dvmask = offs_dv < R
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # only the splits stage 1 filled for this request (a short request in a graph captured for
    # long contexts uses few of them)
    _, _, used = split_range(seq_len, 0, num_splits, 0, min_split, BLOCK_N, False)
    lse_row = part_lse + b * stride_lb + heads[:, None] * stride_lh
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_row + offs_s[None, :], mask=hmask[:, None] & (offs_s < used)[None, :],
                      other=float("-inf"))  # [MERGE_H, BLOCK_S]
    m = tl.max(lse_all, 1)
    # split 0 is never empty, so m is finite except on masked heads: keep those at 0
    m = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp2(lse_all - m[:, None]), 1)
    inv = 1.0 / tl.where(w_sum > 0, w_sum, 1.0)
    acc = tl.zeros([MERGE_H, BLOCK_DV], tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    for s0 in range(0, used, CHUNK_S):
        sidx = s0 + offs_c
        smask = hmask[:, None] & (sidx < used)[None, :]  # [MERGE_H, CHUNK_S]
        w = tl.exp2(tl.load(lse_row + sidx[None, :], mask=smask, other=float("-inf"))
                    - m[:, None]) * inv[:, None]
        o = tl.load(part_o + b * stride_pb + heads[:, None, None] * stride_ph
                    + sidx[None, :, None] * stride_ps + offs_dv[None, None, :],
                    mask=smask[:, :, None] & dvmask[None, None, :], other=0.0)
        acc += tl.sum(o * w[:, :, None], 1)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
             acc.to(Out.dtype.element_ty), mask=hmask[:, None] & dvmask[None, :])


@triton.jit
def _store_latent(Latent, KRope, Buf, Loc, stride_lt, stride_kt, stride_buf, R: tl.constexpr,
                  DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr):
    t = tl.program_id(0)
    row = Buf + tl.load(Loc + t).to(tl.int64) * stride_buf
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    c = tl.load(Latent + t * stride_lt + offs_r, mask=offs_r < R)
    kr = tl.load(KRope + t * stride_kt + offs_dr, mask=offs_dr < DR)
    tl.store(row + offs_r, c.to(Buf.dtype.element_ty), mask=offs_r < R)
    tl.store(row + R + offs_dr, kr.to(Buf.dtype.element_ty), mask=offs_dr < DR)


def store_latent(buf: torch.Tensor, loc: torch.Tensor, latent: torch.Tensor,
                 k_rope: torch.Tensor) -> None:
    """buf[loc] = [latent | k_rope] (cast to the pool's dtype) in one kernel: latent [T, R],
    k_rope [T, Dr], any row strides with a unit last one."""
    T, R = latent.shape
    Dr = k_rope.shape[1]
    if T:
        _store_latent[(T,)](latent, k_rope, buf, loc, latent.stride(0), k_rope.stride(0),
                            buf.stride(0), R=R, DR=Dr, BLOCK_R=triton.next_power_of_2(R),
                            BLOCK_DR=triton.next_power_of_2(Dr), num_warps=4)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs >= 16 along each dimension


def latent_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
                  req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor, *, kv_lora_rank: int, scaling: float,
                  num_splits: int, config: MLADecodeConfig | None = None) -> torch.Tensor:
    """Attention over the latent: q_lat [B, H, R] and q_rope [B, H, Dr] (any strides with a unit
    last one), buf [slots, R + Dr] (the layer's latent buffer), req_to_token [rows, max_ctx],
    req_pool_indices [B], seq_lens [B] (device) -> o_lat [B, H, R] in q_lat's dtype."""
    B, H, R = q_lat.shape
    Dr = q_rope.shape[-1]
    if R != kv_lora_rank or buf.shape[1] != R + Dr:
        raise ValueError(f"latent rows of {buf.shape[1]} values do not hold q_lat's {R} and "
                         f"q_rope's {Dr} (kv_lora_rank {kv_lora_rank})")
    cfg = config or decode_config()
    block_r = _pow2(R)
    part_o = torch.empty(B, H, num_splits, block_r, dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q_lat.device)
    o_lat = torch.empty(B, H, R, dtype=q_lat.dtype, device=q_lat.device)
    if B == 0:
        return o_lat
    # fp32 asks for exact fp32 dots (not TF32); half dtypes take the default
    precision = "ieee" if q_lat.dtype == torch.float32 else None
    hb = head_blocks(H, cfg)
    _mla_decode_stage1[(hb, num_splits, B)](
        q_lat, q_rope, buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        scaling * LOG2E_F, num_splits, cfg.min_split_tokens,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), buf.stride(0),
        req_to_token.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        NUM_HEADS=H, R=R, DR=Dr, BLOCK_H=cfg.block_h, BLOCK_R=block_r, BLOCK_DR=_pow2(Dr),
        BLOCK_N=cfg.block_n, PRECISION=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    block_dv = min(cfg.merge_dv, block_r)
    block_s = max(2, triton.next_power_of_2(num_splits))
    _mla_merge[(triton.cdiv(H, cfg.merge_h), triton.cdiv(R, block_dv), B)](
        part_o, part_lse, o_lat, seq_lens, num_splits, cfg.min_split_tokens,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), o_lat.stride(0), o_lat.stride(1),
        NUM_HEADS=H, R=R, MERGE_H=triton.next_power_of_2(cfg.merge_h), BLOCK_S=block_s,
        CHUNK_S=triton.next_power_of_2(cfg.merge_splits), BLOCK_DV=block_dv, BLOCK_N=cfg.block_n,
        num_warps=4,
    )
    return o_lat


@triton.jit
def _head_matmul(X, W, Out, B, stride_xb, stride_xh, stride_xk, stride_wh, stride_wk,
                 stride_wn, stride_ob, stride_oh, K: tl.constexpr, N: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    nmask = offs_n < N
    acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(X + offs_b[:, None] * stride_xb + h * stride_xh + offs_k[None, :] * stride_xk,
                    mask=bmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + h * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    tl.store(Out + offs_b[:, None] * stride_ob + h * stride_oh + offs_n[None, :],
             acc.to(Out.dtype.element_ty), mask=bmask[:, None] & nmask[None, :])


# Up to this many rows a step, the absorbed products (q_nope @ w_kc, o_lat @ w_vc^T) run as one
# Triton program per (head, column block) instead of cuBLAS's batched GEMM. 0 = off. Session 22
# ran it on an H100 at 32: tests/test_triton_mla.py passes on the GPU (bf16 at DeepSeek shapes
# too), 3.27 us a call, but V2-Lite's batch-1 step did not move (graph replay 3.45 ms against
# session 21's 3.44; bench/RESULTS.md, "DeepSeek MLA on the GPU"): the 6.3 us cuBLAS pair of
# that profile was not these products. Left off; the kernel stays for a shape where it pays.
HEAD_MATMUL_MAX_ROWS = 0


def head_matmul(x: torch.Tensor, w: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
    """Per-head product: x [B, H, K] @ w [H, K, N] -> [B, H, N] in x's dtype (any strides; w
    already in x's dtype). torch.bmm past `max_rows` rows (default HEAD_MATMUL_MAX_ROWS) and on
    the CPU without the interpreter."""
    B, H, K = x.shape
    N = w.shape[2]
    limit = HEAD_MATMUL_MAX_ROWS if max_rows is None else max_rows
    if B > limit or (x.device.type == "cpu" and not interpreting()):
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
    out = torch.empty(B, H, N, dtype=x.dtype, device=x.device)
    if B:
        block_b = 16 if B <= 16 else 32
        block_n = 64 if N > 128 else 32
        precision = "ieee" if x.dtype == torch.float32 else None
        _head_matmul[(H, triton.cdiv(N, block_n), triton.cdiv(B, block_b))](
            x, w, out, B, x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1),
            w.stride(2), out.stride(0), out.stride(1), K=K, N=N, BLOCK_B=block_b, BLOCK_K=64,
            BLOCK_N=block_n, PRECISION=precision, num_warps=4)
    return out


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
               weights: MLAWeights, layer: MLALayerParams, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
               config: MLADecodeConfig | None = None) -> torch.Tensor:
    """One absorbed decode step: q_nope [B, H, Dn], q_rope [B, H, Dr] -> [B, H, Dv] in q's
    dtype (the latent rows of the new tokens already in `buf`)."""
    dtype = q_nope.dtype
    q_lat = head_matmul(q_nope, weights.w_kc.to(dtype))  # [B, H, Dn] @ [H, Dn, R] -> [B, H, R]
    o_lat = latent_decode(q_lat, q_rope, buf, req_to_token, req_pool_indices, seq_lens,
                          kv_lora_rank=layer.kv_lora_rank, scaling=layer.scaling,
                          num_splits=num_splits, config=config)
    # [B, H, R] @ [H, R, Dv] -> [B, H, Dv]
    return head_matmul(o_lat, weights.w_vc.to(dtype).transpose(1, 2))
