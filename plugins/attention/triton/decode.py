"""Split-KV decode attention (flash-decoding) over the paged KV cache.

Stage 1: one program per (request, KV head, head block, KV split) streams its share of the
request's KV tokens once for every query head of the GQA group (the group's heads are the M
dimension of tl.dot, padded to 16 rows), and writes a partial result normalised by its own softmax
sum, plus the log2-sum-exp of its scores. Stage 2 merges the splits of each (request, head), a GQA
group at a time. Token slots are read through req_to_token, so any page size works.

Nothing here reads a device value on the host: the grid depends on the batch size and the split
count alone (a launch-time constant, see common.num_kv_splits), which keeps the path capturable
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins._kit.triton_splitkv import merge_splits as _decode_stage2
from plugins._kit.triton_splitkv import split_range as _split_range
from plugins.attention.triton.common import (
    LOG2E,
    LOG2E_F,
    DecodeConfig,
    decode_config,
    num_kv_splits,
    softcap,
)


# Split counts and lengths are runtime values (not specialised): retuning them, or a graph bucket
# with one split, compiles nothing new.
@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _decode_stage1(
    Q, K, V, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
    sm_scale, qk_scale, cap, window, num_splits, min_split,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens + b).to(tl.int32)
    lo, hi, _ = _split_range(seq_len, split, num_splits, window, min_split, BLOCK_N,
                             USE_WINDOW)

    g = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # index inside the GQA group
    heads = kvh * GROUP + g
    hmask = g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < HEAD_DIM
    dvmask = offs_dv < V_DIM
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    table = req_to_token + row * stride_r2t
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        slots = tl.load(table + offs_n, mask=nmask, other=0).to(tl.int64)
        # K and V are both requested before either is used: twice the bytes in flight.
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_dv[None, :],
                    mask=nmask[:, None] & dvmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if USE_SOFTCAP:
            s = softcap(s * sm_scale, cap) * LOG2E
            s = tl.where(nmask[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # qk_scale = sm_scale * log2(e): one FMA per score inside exp2's argument.
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None],
                     input_precision=PRECISION)
        m = m_new

    # An empty split stores lse = -inf and zeros, which stage 2 weighs by exp2(-inf) = 0.
    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    tl.store(part_o + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
             + offs_dv[None, :], out, mask=hmask[:, None] & dvmask[None, :])
    tl.store(part_lse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def _head_blocking(group: int) -> tuple[int, int]:
    """(BLOCK_H, head blocks): a GQA group's query heads share one program, 16..64 at a time
    (tl.dot needs at least 16 rows; MHA pads its single head)."""
    block_h = min(64, max(16, triton.next_power_of_2(group)))
    return block_h, triton.cdiv(group, block_h)


def decode_splits(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  v_dim: int, dtype: torch.dtype, device: torch.device,
                  config: DecodeConfig | None = None, context: int | None = None) -> int:
    """KV splits the decode kernel uses for this batch shape and longest context (the backend's
    prepare calls it; under CUDA graphs with the largest context the graph may see)."""
    cfg = config or decode_config(head_dim, v_dim, dtype, device)
    _, head_blocks = _head_blocking(num_heads // num_kv_heads)
    return num_kv_splits(batch_size, num_kv_heads, head_blocks, device, cfg, context)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, *, scaling: float, k_scale: float = 1.0,
                     v_scale: float = 1.0, sliding_window: int | None = None,
                     logit_softcap: float | None = None, num_splits: int | None = None,
                     config: DecodeConfig | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per request against its paged KV.

    q [B, H, D]; k_buf [slots, Hkv, D], v_buf [slots, Hkv, Dv] (any dtype, FP8 included:
    real K = k_buf * k_scale); req_to_token [rows, max_ctx] int32; req_pool_indices [B];
    seq_lens [B] (device). Returns [B, H, Dv] in q's dtype. `num_splits` defaults to the
    heuristic for this batch shape without a context bound. sinks: [H] fp32 logits, one per
    query head, in each row's softmax denominator (AttentionLayerParams.sinks).
    """
    B, H, D = q.shape
    Hkv, Dv = k_buf.shape[1], v_buf.shape[2]
    group = H // Hkv
    cfg = config or decode_config(D, Dv, q.dtype, q.device)
    block_h, head_blocks = _head_blocking(group)
    splits = num_splits or num_kv_splits(B, Hkv, head_blocks, q.device, cfg)
    block_dv = triton.next_power_of_2(Dv)
    part_o = torch.empty(B, H, splits, block_dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, Dv, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    # fp32 asks for exact fp32 dots (not TF32); other dtypes take the default (None)
    precision = "ieee" if q.dtype == torch.float32 else None
    window = sliding_window or 0
    use_window = sliding_window is not None
    sm_scale = scaling * k_scale
    _decode_stage1[(B, Hkv * head_blocks, splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        sm_scale, sm_scale * LOG2E_F, logit_softcap or 1.0, window, splits,
        cfg.min_split_tokens,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=D, V_DIM=Dv, BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=block_dv, BLOCK_N=cfg.block_n,
        USE_WINDOW=use_window, USE_SOFTCAP=logit_softcap is not None, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # real V = stored V * v_scale, and the merged softmax weights sum to one: scale the output.
    _decode_stage2[(B, Hkv * head_blocks)](
        part_o, part_lse, out, seq_lens, sinks if sinks is not None else part_lse, v_scale,
        window, splits, cfg.min_split_tokens,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, V_DIM=Dv, BLOCK_H=block_h, BLOCK_DV=block_dv,
        BLOCK_N=cfg.block_n, USE_WINDOW=use_window, USE_SINKS=sinks is not None, num_warps=4,
    )
    return out
