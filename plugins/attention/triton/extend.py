"""Prefill / extend attention over the paged KV cache: cached prefix plus causal new tokens.

One program per (query head, block of BLOCK_M new tokens, request), FlashAttention-2 style. The
new tokens' K/V are already in the pool (the backend writes them first), so every key, prefix or
new, is read through req_to_token: any page size works and FP8 caches are read the same way.

The key range of a block is walked in two loops. Keys older than the block's first query (the
whole cached prefix and the earlier new tokens) are visible to every row: that loop has no mask
and no bounds checks (a sliding window adds its lower edge only). The diagonal, from the last
BLOCK_N boundary at or below the first query up to the last query, carries the causal mask; keys
past the last query are never loaded, so no fully masked block is visited. Scores are scaled by
sm_scale * log2(e) inside exp2's argument (one FMA per score), and P @ V accumulates in place.

Heads are the fastest grid axis, so the query heads of one GQA group run side by side and share
their K/V tiles in L2; the heaviest (last) query blocks start first. A tiling may instead pack a
GQA group into one program (ExtendConfig.pack_gqa): its rows are BLOCK_M / GROUP positions times
the group's heads, and each K/V tile is loaded once for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.attention.triton.common import (
    LOG2E,
    LOG2E_F,
    ExtendConfig,
    autotune_enabled,
    extend_configs,
    extend_table_key,
    interpreting,
    small_extend_config,
    softcap,
)


@triton.jit
def _attend_blocks(acc, l_sum, m, q, k_base, v_base, table, q_pos, lo, hi, sm_scale, qk_scale,
                   cap, window, stride_ks, stride_vs, offs_d, offs_dv, dmask, dvmask,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, FULL_TILES: tl.constexpr,
                   PRECISION: tl.constexpr, IDX64: tl.constexpr):
    """Online softmax over keys [lo, hi); MASKED adds the bounds and causal masks. FULL_TILES:
    no mask at all on the K/V loads (unmasked keys, head dims a power of two). IDX64: offset
    math in 64 bits (some tensor has element offsets of 2^31 or more); else in 32 bits."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            nmask = offs_n < hi
            slots = tl.load(table + offs_n, mask=nmask, other=0)
            kmask = nmask[:, None] & dmask[None, :]
            vmask = nmask[:, None] & dvmask[None, :]
        else:
            slots = tl.load(table + offs_n)
            kmask = dmask[None, :]
            vmask = dvmask[None, :]
        if IDX64:
            slots = slots.to(tl.int64)
        k_ptrs = k_base + slots[:, None] * stride_ks + offs_d[None, :]
        if FULL_TILES:
            k = tl.load(k_ptrs)  # [BLOCK_N, BLOCK_D]
        else:
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            s = softcap(s * sm_scale, cap) * LOG2E  # log2 units from here on
        if MASKED:
            visible = nmask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        elif USE_WINDOW:
            s = tl.where(offs_n[None, :] > q_pos[:, None] - window, s, float("-inf"))
        if USE_SOFTCAP:
            m_new = tl.maximum(m, tl.max(s, 1))
        else:
            m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        if USE_WINDOW:
            # A row may see nothing yet: keep its max at 0 so that exp2 gives 0, not NaN.
            # (Without a window every row sees the first key of the range it starts with.)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if USE_SOFTCAP:
            p = tl.exp2(s - m_use[:, None])
        else:
            p = tl.exp2(s * qk_scale - m_use[:, None])  # one FMA per score
        alpha = tl.exp2(m - m_use)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v_ptrs = v_base + slots[:, None] * stride_vs + offs_dv[None, :]
        if FULL_TILES:
            v = tl.load(v_ptrs)  # [BLOCK_N, BLOCK_DV]
        else:
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None],
                     input_precision=PRECISION)
        m = m_new
    return acc, l_sum, m


# tune_bucket is an autotuning key only: not specialised (0 and 1 would compile twice).
@triton.jit(do_not_specialize=["tune_bucket"])
def _extend_kernel(
    Q, K, V, Out, req_to_token, req_pool_indices, seq_lens, extend_lens, q_starts, Sinks,
    sm_scale, qk_scale, cap, window, out_scale, tune_bucket,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PACK_GQA: tl.constexpr, IDX64: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    # PACK_GQA: the program's BLOCK_M rows are POS positions x the GROUP query heads of one KV
    # head (row r: position r // GROUP, head r % GROUP), so each K/V tile serves the whole group.
    POS: tl.constexpr = BLOCK_M // GROUP if PACK_GQA else BLOCK_M
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest causal blocks first
    b = tl.program_id(2)
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    if mb * POS >= ext_len:
        return
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    prefix = seq_len - ext_len
    q_start = tl.load(q_starts + b).to(tl.int64 if IDX64 else tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kvh = tl.program_id(0)
        heads = kvh * GROUP + offs_r % GROUP  # [BLOCK_M]
        offs_m = mb * POS + offs_r // GROUP
    else:
        kvh = tl.program_id(0) // GROUP
        heads = tl.program_id(0) + offs_r * 0
        offs_m = mb * POS + offs_r
    mmask = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < HEAD_DIM
    dvmask = offs_dv < V_DIM
    rows = q_start + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m

    q_first = prefix + mb * POS
    hi = tl.minimum(q_first + POS, seq_len)  # keys past the block's last query: invisible
    lo = 0
    if USE_WINDOW:
        lo = (tl.maximum(q_first - window + 1, 0) // BLOCK_N) * BLOCK_N
    mid = (q_first // BLOCK_N) * BLOCK_N  # keys below mid precede every query of the block
    mid = tl.maximum(mid, lo)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = req_to_token + row * stride_r2t
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    # Phase 1: keys every row of the block sees (cached prefix, earlier new tokens): no mask.
    acc, l_sum, m = _attend_blocks(
        acc, l_sum, m, q, k_base, v_base, table, q_pos, lo, mid, sm_scale, qk_scale, cap,
        window, stride_ks, stride_vs, offs_d, offs_dv, dmask, dvmask,
        BLOCK_N=BLOCK_N, MASKED=False, USE_WINDOW=USE_WINDOW, USE_SOFTCAP=USE_SOFTCAP,
        FULL_TILES=EVEN_D, PRECISION=PRECISION, IDX64=IDX64)
    # Phase 2: the diagonal blocks, causal mask.
    acc, l_sum, m = _attend_blocks(
        acc, l_sum, m, q, k_base, v_base, table, q_pos, mid, hi, sm_scale, qk_scale, cap,
        window, stride_ks, stride_vs, offs_d, offs_dv, dmask, dvmask,
        BLOCK_N=BLOCK_N, MASKED=True, USE_WINDOW=USE_WINDOW, USE_SOFTCAP=USE_SOFTCAP,
        FULL_TILES=False, PRECISION=PRECISION, IDX64=IDX64)

    if USE_SINKS:  # each row's head sink: one more score, whose value is zero (log2 units)
        sink = tl.load(Sinks + heads).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_fin)
        l_sum = l_sum * rescale + tl.exp2(sink - m_fin)
        acc = acc * rescale[:, None]
    out = acc * (out_scale / tl.where(l_sum > 0, l_sum, 1.0))[:, None]
    tl.store(Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mmask[:, None] & dvmask[None, :])


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into any of these tensors (views included: the largest offset
    is sum((size - 1) * stride)) can reach 2^31. Then the kernel does its offset math in 64 bits;
    below that in 32 bits, which frees registers (prefix 4k + new 4k on the H200: 0.90 -> 0.83
    ms, bench/RESULTS.md)."""
    return any(sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) >= 2**31
               for t in tensors if t.numel())


_TUNED: dict[tuple[tuple[ExtendConfig, ...], int], triton.runtime.Autotuner] = {}


def _tuned_kernel(configs: list[ExtendConfig], group: int):
    """The kernel behind an autotuner over `configs` (one per distinct list and GQA group)."""
    key = (tuple(configs), group)
    if key not in _TUNED:
        _TUNED[key] = triton.autotune(
            configs=[triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                                    "PACK_GQA": c.packs(group)},
                                   **c.launch_options())
                     for c in configs],
            # Dtypes join the key by themselves; tune_bucket (0/1) keeps a short warm-up
            # prefill from choosing the tiling of long ones. No sequence length is a key.
            key=["HEAD_DIM", "V_DIM", "GROUP", "USE_WINDOW", "USE_SOFTCAP", "USE_SINKS",
                 "tune_bucket"],
        )(_extend_kernel)
    return _TUNED[key]


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor,
                     max_extend_len: int, *, scaling: float, k_scale: float = 1.0,
                     v_scale: float = 1.0, sliding_window: int | None = None,
                     logit_softcap: float | None = None,
                     config: ExtendConfig | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens of every request against their cached prefix and themselves (causal).

    q [T, H, D] (request i's tokens at rows q_starts[i] .. + extend_lens[i]); k_buf/v_buf
    [slots, Hkv, D|Dv] with the new tokens already written; seq_lens = prefix + new per request.
    `max_extend_len` (a host int) sizes the grid. Returns [T, H, Dv] in q's dtype. `config` pins
    one tiling instead of the tuning table (benchmarks of tilings use it). sinks: [H] fp32
    logits, one per query head, in each row's softmax denominator.
    """
    T, H, D = q.shape
    Hkv, Dv = k_buf.shape[1], v_buf.shape[2]
    B = seq_lens.shape[0]
    out = torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0 or max_extend_len == 0:
        return out
    sm_scale = scaling * k_scale
    args = (q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, extend_lens, q_starts,
            sinks if sinks is not None else seq_lens, sm_scale, sm_scale * LOG2E_F, logit_softcap or 1.0, sliding_window or 0, v_scale,
            int(max_extend_len >= 1024),
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
            v_buf.stride(1), req_to_token.stride(0), out.stride(0), out.stride(1))
    group = H // Hkv
    consts = dict(GROUP=group, HEAD_DIM=D, V_DIM=Dv, BLOCK_D=triton.next_power_of_2(D),
                  BLOCK_DV=triton.next_power_of_2(Dv), USE_WINDOW=sliding_window is not None,
                  USE_SOFTCAP=logit_softcap is not None,
                  EVEN_D=triton.next_power_of_2(D) == D and triton.next_power_of_2(Dv) == Dv,
                  PRECISION="ieee" if q.dtype == torch.float32 else None,
                  IDX64=needs_int64_offsets(q, k_buf, v_buf, out), USE_SINKS=sinks is not None)
    configs = [config] if config else extend_configs(D, Dv, q.dtype, q.device)
    if config is None and not interpreting():
        small = small_extend_config(configs, H * B, max_extend_len, q.device,
                                    extend_table_key(D, Dv, q.dtype, q.device))
        if small is not None:
            configs = [small]
    if len(configs) == 1 or interpreting() or not autotune_enabled():
        c = configs[0]
        pack = c.packs(group)
        grid = (Hkv if pack else H, triton.cdiv(max_extend_len, c.block_m // (group if pack else 1)),
                B)
        _extend_kernel[grid](*args, **consts, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                             PACK_GQA=pack, **c.launch_options())
    else:
        def grid(meta):
            pack = meta["PACK_GQA"]
            return (Hkv if pack else H,
                    triton.cdiv(max_extend_len, meta["BLOCK_M"] // (group if pack else 1)), B)

        _tuned_kernel(configs, group)[grid](*args, **consts)
    return out
