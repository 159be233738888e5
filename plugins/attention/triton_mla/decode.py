"""Absorbed MLA decode (core.contract.mla), split-KV ("flash-decoding") over the paged latent pool.

Per step: q_lat = q_nope @ w_kc per head (a bmm in the compute dtype), then
- stage 1: one program per (request, block of BLOCK_H heads, KV split) streams its share of the
  request's latent rows once for the whole head block. A row [c | k_rope] (R + Dr values, 576 for
  DeepSeek) is read as two loads, c [R] and k_rope [Dr], each padded to a power of two and masked,
  so the row width itself never has to be one. score = (q_lat . c + q_rope . k_rope) * scaling,
  online softmax in fp32 (exp2), acc += p @ c. It writes the split's o_lat [R] normalised by its
  own sum, and the split's log2-sum-exp;
- stage 2: the split merge shared with the triton backend (plugins/_kit/triton_splitkv.py),
  with the heads of one request as a single GQA group over the o_lat width;
then out = o_lat @ w_vc^T per head (a bmm).

Slots come from req_to_token[req_pool_indices] token by token, so any page size works. Nothing
reads a device value on the host: the grid depends on the batch size, the head count and the
split count (a launch-time constant), which keeps decode capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core.contract.mla import MLALayerParams, MLAWeights
from plugins._kit.triton_splitkv import (
    LOG2E_F,
    DecodeConfig,
    interpreting,
    merge_splits,
    num_kv_splits,
    split_range,
)

# A latent row is wide (R = 512 fp32 accumulators per head): 16 heads a program keep the
# accumulator at 64 registers a thread with 4 warps; smaller KV tiles than the MHA kernel's.
BLOCK_H = 16
# (block_n, num_warps, num_stages, waves, min_split_tokens, max_splits). The split policy is
# the MHA kernel's (triton_splitkv.num_kv_splits) with more splits allowed: a batch-1 step has only
# H / BLOCK_H programs per split, so a 32k context needs ~128 splits to cover an H100/H200.
GPU_CONFIG = DecodeConfig(32, 4, 2, 2, 128, 256)
INTERPRET_CONFIG = DecodeConfig(16, 1, 1, 1, 16, 8)


def decode_config() -> DecodeConfig:
    return INTERPRET_CONFIG if interpreting() else GPU_CONFIG


def head_blocks(num_heads: int) -> int:
    return triton.cdiv(num_heads, BLOCK_H)


def decode_splits(batch_size: int, num_heads: int, device: torch.device,
                  context: int | None = None, config: DecodeConfig | None = None) -> int:
    """KV splits for this batch size, head count and longest context (None: unbounded, as for a
    graph that may replay any context)."""
    cfg = config or decode_config()
    return num_kv_splits(batch_size, 1, head_blocks(num_heads), device, cfg, context)


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
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
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


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs >= 16 along each dimension


def latent_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
                  req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor, *, kv_lora_rank: int, scaling: float,
                  num_splits: int, config: DecodeConfig | None = None) -> torch.Tensor:
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
    hb = head_blocks(H)
    _mla_decode_stage1[(B, hb, num_splits)](
        q_lat, q_rope, buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        scaling * LOG2E_F, num_splits, cfg.min_split_tokens,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), buf.stride(0),
        req_to_token.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        NUM_HEADS=H, R=R, DR=Dr, BLOCK_H=BLOCK_H, BLOCK_R=block_r, BLOCK_DR=_pow2(Dr),
        BLOCK_N=cfg.block_n, PRECISION=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # the heads of a request are one group sharing the single latent "KV head"
    merge_splits[(B, hb)](
        part_o, part_lse, o_lat, seq_lens, part_lse, 1.0, 0, num_splits, cfg.min_split_tokens,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), o_lat.stride(0), o_lat.stride(1),
        GROUP=H, HEAD_BLOCKS=hb, V_DIM=R, BLOCK_H=BLOCK_H, BLOCK_DV=block_r,
        BLOCK_N=cfg.block_n, USE_WINDOW=False, USE_SINKS=False, num_warps=4,
    )
    return o_lat


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
               weights: MLAWeights, layer: MLALayerParams, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
               config: DecodeConfig | None = None) -> torch.Tensor:
    """One absorbed decode step: q_nope [B, H, Dn], q_rope [B, H, Dr] -> [B, H, Dv] in q's
    dtype (the latent rows of the new tokens already in `buf`)."""
    dtype = q_nope.dtype
    # [H, B, Dn] @ [H, Dn, R] -> [H, B, R], viewed as [B, H, R] (no copy: strides go along)
    q_lat = torch.bmm(q_nope.transpose(0, 1), weights.w_kc.to(dtype)).transpose(0, 1)
    o_lat = latent_decode(q_lat, q_rope, buf, req_to_token, req_pool_indices, seq_lens,
                          kv_lora_rank=layer.kv_lora_rank, scaling=layer.scaling,
                          num_splits=num_splits, config=config)
    # [H, B, R] @ [H, R, Dv] -> [H, B, Dv] -> [B, H, Dv]
    return torch.bmm(o_lat.transpose(0, 1), weights.w_vc.to(dtype).transpose(1, 2)
                     ).transpose(0, 1)
