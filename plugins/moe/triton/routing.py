"""Routing and expert alignment in one Triton launch each (the decode path's launch count).

In PyTorch, top-k routing and the sort by expert take some twenty small kernels per MoE layer;
at batch 1 their launches cost more than the expert GEMMs. Here:

- topk_kernel, one program per token: scores (softmax or sigmoid, fp32) over the E experts, k
  rounds of argmax (the best expert first, ties to the lower id as torch.topk does on distinct
  values), optional renormalization and scaling -> ids [T, k] int32, weights [T, k] fp32;
- align_kernel, one program for the whole step (N = T * k rows, small N only): per-expert
  counts, padded offsets, each row's stable rank among its expert's rows, then sorted_ids,
  block_expert and total exactly as `runner.align_by_expert` writes them;
- route_align_kernel, both in one program for decode-sized steps (T <= MAX_ROUTE_TOKENS): every
  token's top-k as topk_kernel computes it, the ids stored, a barrier, then the alignment over
  them, so a decode step's routing is one launch.
With a correction bias [E] (DeepSeek-V3 / Kimi-K2's noaux_tc) both choose on scores + bias and
take each chosen expert's unbiased score as its weight. Grouped top-k (DeepSeek's groups, by
their best score, or noaux_tc's, by the top-2 sum of the biased ones) is in route_align_kernel
only (decode-sized steps); larger grouped steps take the PyTorch path
(core.contract.moe.select_experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# align_kernel holds [N, N] and [N, E] comparison tiles in one program: small steps only.
MAX_ALIGN_ROWS = 128
MAX_ALIGN_EXPERTS = 256
MAX_TOPK_EXPERTS = 4096  # one program holds a token's E scores
# One warp: these programs are chains of small reductions over a few thousand elements at most,
# and a warp reduces by shuffles alone (more warps add a shared-memory round trip to each).
_ROUTE_WARPS = 1
# route_align_kernel holds every token's E scores in one program besides the alignment's tiles
MAX_ROUTE_TOKENS = 16
# grouped top-k in route_align_kernel: a few reductions per group, unrolled (DeepSeek: 8)
MAX_ROUTE_GROUPS = 16


@triton.jit
def topk_kernel(logits_ptr, ids_ptr, weights_ptr, bias_ptr, num_experts, stride_l, scale,
                TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(mask, tl.sigmoid(x), -float("inf"))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = tl.where(mask, e / tl.sum(e, axis=0), -float("inf"))
    # noaux_tc: the choice on scores + bias, the weights the chosen experts' unbiased scores
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        choice = tl.where(mask, scores + bias, -float("inf"))
    ks = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        # the lowest id among the maxima
        idx = tl.min(tl.where(choice == best, offs, BLOCK_E), axis=0)
        chosen = tl.where(ks == j, idx, chosen)
        if HAS_BIAS:  # the chosen expert's unbiased score
            best = tl.sum(tl.where(offs == idx, scores, 0.0), axis=0)
        weights = tl.where(ks == j, best, weights)
        choice = tl.where(offs == idx, -float("inf"), choice)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    weights = weights * scale
    k_ok = ks < TOP_K
    tl.store(ids_ptr + t * TOP_K + ks, chosen, mask=k_ok)
    tl.store(weights_ptr + t * TOP_K + ks, weights, mask=k_ok)


@triton.jit
def _align(ids_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, num_rows, num_experts, worst,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hit = (ids[:, None] == experts[None, :]) & row_ok[:, None]  # [N, E]
    counts = tl.sum(hit.to(tl.int32), axis=0)  # [E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    # rank of row i among the earlier rows of its expert (stable, as the argsort path)
    cols = tl.arange(0, BLOCK_N)
    same = (ids[:, None] == ids[None, :]) & (cols[None, :] < rows[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)  # [N]
    start = tl.sum(tl.where(hit, padded_start[None, :], 0), axis=1)  # [N]
    # every slot the padding, then each row at its place (one program: a barrier orders them)
    for w0 in range(0, worst, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        tl.store(sorted_ids_ptr + offs_w, tl.full((BLOCK_W,), 0, tl.int32) + num_rows,
                 mask=offs_w < worst)
    tl.debug_barrier()
    tl.store(sorted_ids_ptr + start + rank, rows.to(tl.int32), mask=row_ok)
    blocks = tl.arange(0, BLOCK_B)
    block_start = blocks * BLOCK_M
    e_ok = experts < num_experts
    # the expert of block b: how many experts' padded groups end at or before its first row
    expert_of = tl.sum(((padded_end[None, :] <= block_start[:, None]) & e_ok[None, :])
                       .to(tl.int32), axis=1)
    expert_of = tl.minimum(expert_of, num_experts - 1)
    tl.store(block_expert_ptr + blocks, expert_of, mask=block_start < worst)
    tl.store(total_ptr, tl.sum(padded, axis=0).to(tl.int64))


@triton.jit
def align_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, num_rows, num_experts,
                 worst, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr):
    _align(ids_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, num_rows, num_experts, worst,
           BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_W, BLOCK_B)


@triton.jit
def _limit_to_groups(choice, offs, group_size, NUM_GROUPS: tl.constexpr,
                     TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, TOP2_SUM: tl.constexpr):
    """core.contract.moe.limit_to_groups on a [BLOCK_T, BLOCK_E] tile (padded experts at
    -inf): each group ranked by its best value (TOP2_SUM: the sum of its two best, noaux_tc),
    the best TOPK_GROUPS groups kept (ties to the lower group, as on distinct values), every
    other expert set to 0 (-inf with TOP2_SUM)."""
    grp = offs // group_size  # [BLOCK_E]
    gs = tl.arange(0, BLOCK_G)
    group_score = tl.full((choice.shape[0], BLOCK_G), -float("inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        in_g = (grp == g)[None, :]
        vals = tl.where(in_g, choice, -float("inf"))
        best = tl.max(vals, axis=1)
        if TOP2_SUM:  # the best, then the best of the rest (a tie: the same value again)
            first = tl.min(tl.where(vals == best[:, None], offs[None, :], 1 << 30), axis=1)
            best += tl.max(tl.where(offs[None, :] == first[:, None], -float("inf"), vals),
                           axis=1)
        group_score = tl.where(gs[None, :] == g, best[:, None], group_score)
    kept = tl.zeros((choice.shape[0], BLOCK_G), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        top = tl.max(group_score, axis=1)
        g_idx = tl.min(tl.where(group_score == top[:, None], gs[None, :], BLOCK_G), axis=1)
        hit = gs[None, :] == g_idx[:, None]
        kept = tl.where(hit, 1, kept)
        group_score = tl.where(hit, -float("inf"), group_score)
    eligible = tl.zeros(choice.shape, dtype=tl.int32)
    for g in tl.static_range(NUM_GROUPS):
        keep_g = tl.max(tl.where(gs[None, :] == g, kept, 0), axis=1)  # [BLOCK_T]
        eligible = tl.where((grp == g)[None, :] & (keep_g[:, None] > 0), 1, eligible)
    fill = -float("inf") if TOP2_SUM else 0.0
    return tl.where(eligible > 0, choice, tl.where(choice == -float("inf"), choice, fill))


@triton.jit
def route_align_kernel(logits_ptr, ids_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
                       total_ptr, bias_ptr, num_tokens, num_experts, stride_l, scale, worst,
                       TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_B: tl.constexpr, HAS_BIAS: tl.constexpr = False,
                       NUM_GROUPS: tl.constexpr = 0, TOPK_GROUPS: tl.constexpr = 0,
                       BLOCK_G: tl.constexpr = 1):
    # top-k of every token at once: scores [BLOCK_T, BLOCK_E], the math of topk_kernel per row
    toks = tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BLOCK_E)
    t_ok = toks < num_tokens
    mask = t_ok[:, None] & (offs[None, :] < num_experts)
    x = tl.load(logits_ptr + toks[:, None] * stride_l + offs[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(mask, tl.sigmoid(x), -float("inf"))
    else:
        top = tl.max(x, axis=1)
        top = tl.where(t_ok, top, 0.0)  # padded tokens: no inf - inf
        e = tl.where(mask, tl.exp(x - top[:, None]), 0.0)
        total = tl.sum(e, axis=1)
        total = tl.where(t_ok, total, 1.0)
        scores = tl.where(mask, e / total[:, None], -float("inf"))
    choice = scores  # noaux_tc: chosen on scores + bias, weighted by the scores (topk_kernel)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=offs < num_experts, other=0.0).to(tl.float32)
        choice = tl.where(mask, scores + bias[None, :], -float("inf"))
    if NUM_GROUPS > 0:  # grouped top-k (DeepSeek's); with a bias, noaux_tc's top-2-sum groups
        choice = _limit_to_groups(choice, offs, num_experts // NUM_GROUPS, NUM_GROUPS,
                                  TOPK_GROUPS, BLOCK_G, HAS_BIAS)
        if not HAS_BIAS:  # the weights are the limited scores themselves (select_experts)
            scores = choice
    ks = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], offs[None, :], BLOCK_E), axis=1)
        picked = offs[None, :] == idx[:, None]
        if HAS_BIAS:  # the chosen experts' unbiased scores
            best = tl.sum(tl.where(picked, scores, 0.0), axis=1)
        chosen = tl.where(ks[None, :] == j, idx[:, None], chosen)
        weights = tl.where(ks[None, :] == j, best[:, None], weights)
        choice = tl.where(picked, -float("inf"), choice)
    if RENORM:
        wsum = tl.sum(tl.where(ks[None, :] < TOP_K, weights, 0.0), axis=1)
        wsum = tl.where(t_ok, wsum, 1.0)
        weights = weights / wsum[:, None]
    weights = weights * scale
    ok = t_ok[:, None] & (ks[None, :] < TOP_K)
    flat = toks[:, None] * TOP_K + ks[None, :]
    tl.store(ids_ptr + flat, chosen, mask=ok)
    tl.store(weights_ptr + flat, weights, mask=ok)
    tl.debug_barrier()  # one program: the ids just stored are read back, flat, below
    _align(ids_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, num_tokens * TOP_K,
           num_experts, worst, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_W, BLOCK_B)


def _bias_arg(bias: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """The correction bias [E] as the kernels read it (contiguous), or an unused pointer."""
    return logits if bias is None else bias.contiguous()


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str,
               scale: float = 1.0, correction_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int32) in one launch; see core.contract.moe.select_experts
    (ungrouped; with a correction bias [E], noaux_tc's choice on scores + bias)."""
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    topk_kernel[(T,)](logits, ids, weights, _bias_arg(correction_bias, logits), E,
                      logits.stride(0), float(scale), TOP_K=top_k,
                      BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                      SIGMOID=scoring_func == "sigmoid", RENORM=renormalize,
                      HAS_BIAS=correction_bias is not None, num_warps=1 if E <= 1024 else 4)
    return weights, ids


def _align_buffers(n: int, num_experts: int, block_m: int, device: torch.device
                   ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    worst = n + min(n, num_experts) * (block_m - 1)
    worst = (worst + block_m - 1) // block_m * block_m
    sorted_ids = torch.empty(worst, dtype=torch.int32, device=device)
    block_expert = torch.empty(worst // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int64, device=device)
    blocks = {"BLOCK_M": block_m, "BLOCK_N": max(16, triton.next_power_of_2(n)),
              "BLOCK_E": max(16, triton.next_power_of_2(num_experts)), "BLOCK_W": 256,
              "BLOCK_B": max(16, triton.next_power_of_2(worst // block_m))}
    return worst, sorted_ids, block_expert, total, blocks


def fused_align(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`runner.align_by_expert` in one launch, for N <= MAX_ALIGN_ROWS rows."""
    flat = ids.reshape(-1)
    n = flat.numel()
    worst, sorted_ids, block_expert, total, blocks = _align_buffers(n, num_experts, block_m,
                                                                    flat.device)
    align_kernel[(1,)](flat, sorted_ids, block_expert, total, n, num_experts, worst, **blocks,
                       num_warps=_ROUTE_WARPS)
    return sorted_ids, block_expert, total


def can_route_align(num_tokens: int, num_experts: int, top_k: int,
                    grouped_topk: tuple[int, int] | None = None) -> bool:
    """route_and_align takes this step (one program: a decode-sized step). Grouped top-k when
    the groups split the experts evenly and the kept groups hold at least top_k experts (else
    zero-filled experts would be chosen, in an order select_experts leaves to torch.topk)."""
    if grouped_topk is not None:
        groups, kept = grouped_topk
        if (num_experts % groups or not 1 <= kept <= groups or groups > MAX_ROUTE_GROUPS
                or kept * (num_experts // groups) < top_k):
            return False
    return (num_tokens <= MAX_ROUTE_TOKENS and num_tokens * top_k <= MAX_ALIGN_ROWS
            and num_experts <= MAX_ALIGN_EXPERTS)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                    scoring_func: str, scale: float, block_m: int,
                    correction_bias: torch.Tensor | None = None,
                    grouped_topk: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """fused_topk then fused_align in one launch (see can_route_align):
    (weights [T, k] fp32, ids [T, k] int32, sorted_ids, block_expert, total)."""
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    ids = torch.empty(T, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    worst, sorted_ids, block_expert, total, blocks = _align_buffers(T * top_k, E, block_m,
                                                                    device)
    groups, kept = grouped_topk or (0, 0)
    route_align_kernel[(1,)](logits, ids, weights, sorted_ids, block_expert, total,
                             _bias_arg(correction_bias, logits), T, E,
                             logits.stride(0), float(scale), worst, TOP_K=top_k,
                             BLOCK_T=max(2, triton.next_power_of_2(T)),
                             BLOCK_K=triton.next_power_of_2(top_k),
                             SIGMOID=scoring_func == "sigmoid", RENORM=renormalize, **blocks,
                             HAS_BIAS=correction_bias is not None,
                             NUM_GROUPS=groups, TOPK_GROUPS=kept,
                             BLOCK_G=triton.next_power_of_2(max(groups, 1)),
                             num_warps=_ROUTE_WARPS)
    return weights, ids, sorted_ids, block_expert, total
