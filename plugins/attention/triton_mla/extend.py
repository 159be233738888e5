"""Materialised MLA extend (prefill, chunked prefill, cached prefix; core.contract.mla).

The queries of an extend share the expansion of the latent, so per request the cached rows are
expanded through kv_b_proj a chunk of tokens at a time: k_nope = c @ w_kc^T and v = c @ w_vc^T
per head (bmm in the compute dtype), k_rope as stored (one for all heads). A Triton
flash-attention kernel then folds the chunk into each query's running softmax state (max, sum
and the Dv-wide accumulator, fp32, kept in global memory between chunks), causal in absolute
positions: query j of a request with `prefix` cached tokens sits at prefix + j and sees keys
<= prefix + j. The last chunk's launch divides and writes the output. Memory is bounded by the
chunk (H x chunk x (Dn + Dv) expanded values) and the queries' state, not by the context.

Scores are two dots, q_nope . k_nope and q_rope . k_rope, each width padded to a power of two
(at least 16) and masked, so Dn + Dr = 192 and Dv = 128 (DeepSeek), Dqk != Dv and non powers of
two all work. The grid is sized from host lengths: extend is never captured in a CUDA graph.

A step's requests are taken together (`plan_extend` once per step, `extend_batch` per layer):
consecutive requests whose cached rows fit one chunk together form a group, whose rows are
gathered and expanded with one pair of products and attended by one launch over every query
block of the group (`_mla_extend_varlen`: each program finds its request in a block table).
A request longer than a chunk goes alone through `extend_request`'s chunk loop. Both kernels
fold key blocks with the same `_fold`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from core.contract.mla import MLALayerParams, MLAWeights
from plugins._kit.triton_splitkv import LOG2E_F, interpreting


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64  # query rows per program
    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 2
    # expanded values (H x chunk x (Dn + Dv)) one chunk may hold: 64 MiB in bf16
    chunk_values: int = 1 << 25


def extend_config(dtype: torch.dtype) -> ExtendConfig:
    if interpreting():
        return ExtendConfig(16, 16, 1, 1)
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory: halve them
        return ExtendConfig(32, 32, 4, 2)
    return ExtendConfig()


def chunk_tokens(num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 cfg: ExtendConfig) -> int:
    """Keys expanded at a time: as many as cfg.chunk_values allows, a multiple of block_n."""
    per_token = num_heads * (qk_nope_head_dim + v_head_dim)
    return max(cfg.block_n, cfg.chunk_values // per_token // cfg.block_n * cfg.block_n)


@triton.jit
def _fold(q_n, q_r, m, l_sum, acc, K_nope, K_rope, V, stride_knn, stride_krn, stride_vn,
          q_abs, key0, hi, offs_dn, offs_dr, offs_dv, qk_scale,
          DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
          PRECISION: tl.constexpr):
    """Keys [0, hi) of the expanded chunk (K_nope / V at this head, key n at absolute position
    key0 + n) folded into the queries' running softmax state (m, l_sum, acc): causal in
    absolute positions, scores in log2 units."""
    dvmask = offs_dv < DV
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        k_n = tl.load(K_nope + offs_n[:, None] * stride_knn + offs_dn[None, :],
                      mask=nmask[:, None] & (offs_dn < DN)[None, :], other=0.0)
        k_r = tl.load(K_rope + offs_n[:, None] * stride_krn + offs_dr[None, :],
                      mask=nmask[:, None] & (offs_dr < DR)[None, :], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_dv[None, :],
                    mask=nmask[:, None] & dvmask[None, :], other=0.0)
        s = tl.dot(q_n, tl.trans(k_n.to(q_n.dtype)), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(k_r.to(q_r.dtype)), s, input_precision=PRECISION)
        visible = nmask[None, :] & ((key0 + offs_n)[None, :] <= q_abs[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf: keep exp2's argument finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    return m, l_sum, acc


# Lengths and offsets are runtime values (not specialised): each new length compiles nothing.
@triton.jit(do_not_specialize=["q_pos0", "n_new", "key0", "n_keys"])
def _mla_extend_chunk(
    Q_nope, Q_rope, K_nope, K_rope, V, State_m, State_l, State_acc, Out,
    qk_scale, q_pos0, n_new, key0, n_keys,
    stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_knh, stride_knn, stride_krn,
    stride_vh, stride_vn, stride_sh, stride_ah, stride_at, stride_ot, stride_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    mmask = offs_m < n_new
    dvmask = offs_dv < DV
    q_n = tl.load(Q_nope + offs_m[:, None] * stride_qnt + h * stride_qnh + offs_dn[None, :],
                  mask=mmask[:, None] & (offs_dn < DN)[None, :], other=0.0)
    q_r = tl.load(Q_rope + offs_m[:, None] * stride_qrt + h * stride_qrh + offs_dr[None, :],
                  mask=mmask[:, None] & (offs_dr < DR)[None, :], other=0.0)
    state = h * stride_sh + offs_m
    acc_ptr = State_acc + h * stride_ah + offs_m[:, None] * stride_at + offs_dv[None, :]
    amask = mmask[:, None] & dvmask[None, :]
    if FIRST:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    else:
        m = tl.load(State_m + state, mask=mmask, other=float("-inf"))
        l_sum = tl.load(State_l + state, mask=mmask, other=0.0)
        acc = tl.load(acc_ptr, mask=amask, other=0.0)

    q_abs = q_pos0 + offs_m  # the queries' positions in the sequence
    # keys past this block's last query are invisible to all of it
    hi = tl.minimum(n_keys, q_pos0 + tl.minimum(mb * BLOCK_M + BLOCK_M, n_new) - key0)
    m, l_sum, acc = _fold(q_n, q_r, m, l_sum, acc, K_nope + h * stride_knh, K_rope,
                          V + h * stride_vh, stride_knn, stride_krn, stride_vn, q_abs, key0, hi,
                          offs_dn, offs_dr, offs_dv, qk_scale, DN, DR, DV, BLOCK_N, PRECISION)

    if LAST:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(Out + offs_m[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=amask)
    else:
        tl.store(State_m + state, m, mask=mmask)
        tl.store(State_l + state, l_sum, mask=mmask)
        tl.store(acc_ptr, acc, mask=amask)


@triton.jit
def _mla_extend_varlen(
    Q_nope, Q_rope, K_nope, K_rope, V, Out, Blocks, Reqs, qk_scale,
    stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_knh, stride_knn, stride_krn,
    stride_vh, stride_vn, stride_ot, stride_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Every query block of a group of requests, each over its own expanded rows (all of them
    in this one chunk). Blocks [n_blocks, 2]: (request, first query row of the block within
    it); Reqs [n_reqs, 4]: (first query row in Q, new tokens, first key row in K_nope / V /
    K_rope, keys = the request's tokens)."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.load(Blocks + 2 * blk)
    m0 = tl.load(Blocks + 2 * blk + 1)
    q0 = tl.load(Reqs + 4 * r).to(tl.int64)
    n_new = tl.load(Reqs + 4 * r + 1)
    k0 = tl.load(Reqs + 4 * r + 2).to(tl.int64)
    n_keys = tl.load(Reqs + 4 * r + 3)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # rows within the request
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    mmask = offs_m < n_new
    rows = q0 + offs_m
    q_n = tl.load(Q_nope + rows[:, None] * stride_qnt + h * stride_qnh + offs_dn[None, :],
                  mask=mmask[:, None] & (offs_dn < DN)[None, :], other=0.0)
    q_r = tl.load(Q_rope + rows[:, None] * stride_qrt + h * stride_qrh + offs_dr[None, :],
                  mask=mmask[:, None] & (offs_dr < DR)[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    q_pos0 = n_keys - n_new
    hi = tl.minimum(n_keys, q_pos0 + tl.minimum(m0 + BLOCK_M, n_new))
    m, l_sum, acc = _fold(q_n, q_r, m, l_sum, acc, K_nope + h * stride_knh + k0 * stride_knn,
                          K_rope + k0 * stride_krn, V + h * stride_vh + k0 * stride_vn,
                          stride_knn, stride_krn, stride_vn, q_pos0 + offs_m, 0, hi, offs_dn,
                          offs_dr, offs_dv, qk_scale, DN, DR, DV, BLOCK_N, PRECISION)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mmask[:, None] & (offs_dv < DV)[None, :])


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs >= 16 along each dimension


def extend_request(q_nope: torch.Tensor, q_rope: torch.Tensor, rows_of: torch.Tensor,
                   buf: torch.Tensor, weights: MLAWeights, layer: MLALayerParams,
                   out: torch.Tensor, chunk: int | None = None,
                   config: ExtendConfig | None = None) -> None:
    """One request: q_nope [n, H, Dn], q_rope [n, H, Dr] of its last n tokens, rows_of [S] the
    slots of its S tokens in `buf` [slots, R + Dr] (the n new rows written) -> out [n, H, Dv]
    (written in place). `chunk`: keys expanded at a time (default from the config)."""
    n, H, Dn = q_nope.shape
    Dr, Dv, R = q_rope.shape[-1], layer.v_head_dim, layer.kv_lora_rank
    S = rows_of.shape[0]
    if n == 0:
        return
    dtype = q_nope.dtype
    cfg = config or extend_config(dtype)
    chunk = chunk or chunk_tokens(H, Dn, Dv, cfg)
    w_kc_t = weights.w_kc.to(dtype).transpose(1, 2)  # [H, R, Dn]
    w_vc_t = weights.w_vc.to(dtype).transpose(1, 2)  # [H, R, Dv]
    block_dv = _pow2(Dv)
    grid = (triton.cdiv(n, cfg.block_m), H)
    many = S > chunk
    if many:  # the running softmax state, carried from chunk to chunk
        state_m = torch.empty(H, n, dtype=torch.float32, device=q_nope.device)
        state_l = torch.empty_like(state_m)
        state_acc = torch.empty(H, n, Dv, dtype=torch.float32, device=q_nope.device)
    else:
        state_m = state_l = state_acc = out  # never read or written (FIRST and LAST)
    precision = "ieee" if dtype == torch.float32 else None
    for key0 in range(0, S, chunk):
        rows = buf[rows_of[key0:key0 + chunk]]  # [L, R + Dr]
        c = rows[:, :R].to(dtype)
        k_nope = torch.matmul(c, w_kc_t)  # [L, R] @ [H, R, Dn] -> [H, L, Dn]
        v = torch.matmul(c, w_vc_t)  # [H, L, Dv]
        k_rope = rows[:, R:]  # [L, Dr], shared by the heads
        _mla_extend_chunk[grid](
            q_nope, q_rope, k_nope, k_rope, v, state_m, state_l, state_acc, out,
            layer.scaling * LOG2E_F, S - n, n, key0, rows.shape[0],
            q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
            k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), v.stride(0), v.stride(1),
            state_m.stride(0) if many else 0, state_acc.stride(0) if many else 0,
            state_acc.stride(1) if many else 0, out.stride(0), out.stride(1),
            DN=Dn, DR=Dr, DV=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DN=_pow2(Dn),
            BLOCK_DR=_pow2(Dr), BLOCK_DV=block_dv, FIRST=key0 == 0, LAST=key0 + chunk >= S,
            PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


@dataclass(frozen=True)
class ExtendGroup:
    """Requests extended together (one expansion, one launch), or one long request alone."""

    first: int  # index of its first request in the step
    count: int  # requests
    q_rows: slice  # its rows of the step's queries
    slots: torch.Tensor  # [keys] int64: every request's cached rows, request after request
    blocks: torch.Tensor | None = None  # [n_blocks, 2] int32 (None: a long request alone)
    reqs: torch.Tensor | None = None  # [count, 4] int32 (_mla_extend_varlen's table)


def plan_extend(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                seq_lens: list[int], extend_lens: list[int], chunk: int, block_m: int
                ) -> list[ExtendGroup]:
    """Once per step: consecutive requests grouped while their keys (cached tokens) fit
    `chunk` together; a request of more keys alone. Each group's slots and tables are built
    with one host-to-device copy and one gather from req_to_token."""
    groups: list[ExtendGroup] = []
    device = req_to_token.device
    i, q0, n = 0, 0, len(seq_lens)
    while i < n:
        j, keys = i, 0
        while j < n and (j == i or keys + seq_lens[j] <= chunk) and \
                (seq_lens[j] <= chunk or j == i):
            keys += seq_lens[j]
            j += 1
            if seq_lens[j - 1] > chunk:  # a long one goes alone
                break
        new = sum(extend_lens[i:j])
        lens = seq_lens[i:j]
        if j - i == 1 and lens[0] > chunk:
            row = req_to_token[req_pool_indices[i], :lens[0]].long()
            groups.append(ExtendGroup(i, 1, slice(q0, q0 + new), row))
        else:
            blocks, reqs, k0, r0 = [], [], 0, q0
            for r, (seq, e) in enumerate(zip(lens, extend_lens[i:j], strict=True)):
                blocks += [x for mb in range(0, e, block_m) for x in (r, mb)]
                reqs += [r0, e, k0, seq]
                k0, r0 = k0 + seq, r0 + e
            host = torch.tensor([*lens, *reqs, *blocks], dtype=torch.int32)
            meta = host.to(device, non_blocking=True)
            lens_t = meta[:j - i].long()
            reqs_t = meta[j - i:j - i + 4 * (j - i)].view(j - i, 4)
            blocks_t = meta[j - i + 4 * (j - i):].view(-1, 2)
            owner = torch.repeat_interleave(req_pool_indices[i:j], lens_t, output_size=keys)
            starts = torch.repeat_interleave(reqs_t[:, 2].long(), lens_t, output_size=keys)
            pos = torch.arange(keys, device=device) - starts
            slots = req_to_token[owner, pos].long()
            groups.append(ExtendGroup(i, j - i, slice(q0, q0 + new), slots, blocks_t, reqs_t))
        q0 += new
        i = j
    return groups


def extend_batch(q_nope: torch.Tensor, q_rope: torch.Tensor, groups: list[ExtendGroup],
                 buf: torch.Tensor, weights: MLAWeights, layer: MLALayerParams,
                 out: torch.Tensor, config: ExtendConfig | None = None) -> None:
    """A step's extend over plan_extend's groups: q_nope [T, H, Dn], q_rope [T, H, Dr] (the
    step's new tokens, request after request) -> out [T, H, Dv] (written in place)."""
    _, H, Dn = q_nope.shape
    Dr, Dv, R = q_rope.shape[-1], layer.v_head_dim, layer.kv_lora_rank
    dtype = q_nope.dtype
    cfg = config or extend_config(dtype)
    w_kc_t = weights.w_kc.to(dtype).transpose(1, 2)  # [H, R, Dn]
    w_vc_t = weights.w_vc.to(dtype).transpose(1, 2)  # [H, R, Dv]
    precision = "ieee" if dtype == torch.float32 else None
    for g in groups:
        if g.blocks is None:  # a request longer than a chunk: the chunk loop
            rows = g.q_rows
            extend_request(q_nope[rows], q_rope[rows], g.slots, buf, weights, layer, out[rows],
                           config=cfg)
            continue
        n_blocks = g.blocks.shape[0]
        if n_blocks == 0:
            continue
        latent = buf[g.slots]  # [keys, R + Dr]
        c = latent[:, :R].to(dtype)
        k_nope = torch.matmul(c, w_kc_t)  # [H, keys, Dn]
        v = torch.matmul(c, w_vc_t)  # [H, keys, Dv]
        k_rope = latent[:, R:]
        _mla_extend_varlen[(n_blocks, H)](
            q_nope, q_rope, k_nope, k_rope, v, out, g.blocks, g.reqs, layer.scaling * LOG2E_F,
            q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
            k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            DN=Dn, DR=Dr, DV=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DN=_pow2(Dn),
            BLOCK_DR=_pow2(Dr), BLOCK_DV=_pow2(Dv), PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
