"""Build one MoE conformance case, run a runner on it, check everything it did.

Inputs: hidden ~ N(0, 1), expert weights scaled so outputs are O(1), and router logits spread on
a grid of 0.1 (a random order of experts per token), so that no two experts tie in any compute
dtype and every correct runner picks the same experts. Routings: "random"; "one_expert" (every
token's best expert is the last one); "few_experts" (every token picks among the same k + 1).

Checks, in order (the first failure raises AssertionError saying what went wrong):
1. the result is `out` (when given), has shape [T, H] and hidden's dtype, and every element is
   finite (`out` is pre-filled with NaN: an element never written shows);
2. the inputs (hidden, router logits, shared output) are unchanged;
3. it matches the fp32 reference (routing by core.contract.moe.select_experts on the same logits,
   routed_scaling_factor included, a loop over the experts in fp32 from the same rounded
   weights, GELU in its exact erf form, swigluoai as transformers' GptOssExperts computes it,
   the expert biases where the case has them; noaux_tc's routing with a correction bias by
   its own token-by-token reference, reference_routing), at the dtype's tolerance;
4. called without `out` (cases of up to 8 tokens), it returns a new tensor, equally close.
On a CUDA device, for a runner that declares cuda_graph, `check_graph_case` also captures a
decode-sized call in a CUDA graph and replays it on new inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conformance.attention_check import _poison_allocator
from conformance.moe_cases import MoECase
from core.contract.moe import MoELayerParams, MoEWeights, select_experts
from core.plan.registry import Registration

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
# (atol, rtol), atol relative to the reference's largest magnitude
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (5e-3, 5e-3), "bfloat16": (4e-2, 4e-2)}
# core.contract.moe.MoELayerParams.activation: "gelu" is the exact erf form, not tanh's
_ACTS = {"silu": F.silu, "gelu": lambda x: F.gelu(x, approximate="none")}


def reference_glu(h: torch.Tensor, layer: MoELayerParams) -> torch.Tensor:
    """[n, 2I] = [gate | up] fp32 -> [n, I]: the activation as the contract states it, written
    apart from core.contract.moe.gated_activation. swigluoai, from transformers' GptOssExperts:
    gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate)."""
    inter = h.shape[-1] // 2
    gate, up = h[:, :inter], h[:, inter:]
    if layer.activation == "swigluoai":
        limit = layer.swiglu_limit
        gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
        up = torch.where(up > limit, torch.full_like(up, limit),
                         torch.where(up < -limit, torch.full_like(up, -limit), up))
        return (up + 1.0) * gate / (1.0 + torch.exp(-layer.swiglu_alpha * gate))
    return _ACTS[layer.activation](gate) * up


@dataclass
class MoEInputs:
    case: MoECase
    hidden: torch.Tensor  # [T, H] compute dtype
    logits: torch.Tensor  # [T, E] compute dtype
    weights: MoEWeights
    layer: MoELayerParams
    shared: torch.Tensor | None  # [T, H] compute dtype


def routing_logits(case: MoECase, gen: torch.Generator) -> torch.Tensor:
    """[T, E] fp32 logits, distinct per token by at least 0.1 (no ties after rounding)."""
    T, E, k = case.tokens, case.experts, case.top_k
    levels = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float()
    if case.routing == "one_expert":  # expert E-1 first for every token
        levels[levels == E - 1] = -1.0
        levels.scatter_(1, torch.full((T, 1), E - 1), float(E))
    elif case.routing == "few_experts":  # the same k + 1 experts lead for every token
        chosen = torch.randperm(E, generator=gen)[:k + 1]
        lead = torch.stack([torch.randperm(k + 1, generator=gen) for _ in range(T)]).float()
        levels = levels.masked_fill(torch.isin(torch.arange(E), chosen), -E)
        levels[:, chosen] = E + lead
    elif case.routing != "random":
        raise ValueError(f"unknown routing {case.routing!r}")
    # ranks -> a grid of 0.1 centred on 0; noaux_tc cases: within [-2, 2] (sigmoid scores
    # that do not saturate, so the weights tell experts apart; draw_correction_bias checks
    # that the biased choice has no near-ties)
    ranks = levels.argsort(dim=1).argsort(dim=1).float()
    return (ranks - E / 2) * (min(0.1, 4.0 / E) if case.correction_bias else 0.1)


# noaux_tc cases: every choice the routing makes (the k-th expert against the next, the last
# kept group against the next) is won by at least this much, in fp32 on the case's own logits,
# so that any correct runner picks the same experts
CHOICE_MARGIN = 1e-5


def reference_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[T, E] fp32 scores, written apart from core.contract.moe.expert_scores."""
    x = logits.float()
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def noaux_tc_choice(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                    groups: tuple[int, int] | None, rank_groups_by: str = "top2_sum"
                    ) -> tuple[list[list[int]], float]:
    """DeepSeek-V3's choice, token by token, written apart from core.contract.moe: each
    token's experts (best first) chosen on scores + bias (bias None: on the scores), among the
    best groups[1] of groups[0] groups ranked by the sum of their two best biased scores
    (rank_groups_by "max": by their best one, a planted mistake's choice); and the smallest
    margin by which any of these choices was won."""
    choice = scores.float() + (0.0 if bias is None else bias.float().cpu())
    T, E = choice.shape
    chosen, margin = [], float("inf")
    for t in range(T):
        row = choice[t].tolist()
        eligible = list(range(E))
        if groups is not None:
            size = E // groups[0]
            ranked = []
            for g in range(groups[0]):
                top = sorted(row[g * size:(g + 1) * size], reverse=True)
                ranked.append((top[0] + top[1] if rank_groups_by == "top2_sum" else top[0], g))
            ranked.sort(reverse=True)
            kept = [g for _, g in ranked[:groups[1]]]
            if groups[1] < groups[0]:
                margin = min(margin, ranked[groups[1] - 1][0] - ranked[groups[1]][0])
            eligible = [e for e in eligible if e // size in kept]
        order = sorted(eligible, key=lambda e: -row[e])
        if top_k < len(order):
            margin = min(margin, row[order[top_k - 1]] - row[order[top_k]])
        chosen.append(order[:top_k])
    return chosen, margin


def reference_routing(logits: torch.Tensor, layer: MoELayerParams
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k]) for a noaux_tc layer: the experts noaux_tc_choice picks,
    weighted by their unbiased scores, renormalized when asked, times routed_scaling_factor."""
    scores = reference_scores(logits.cpu(), layer.scoring_func)
    chosen, _ = noaux_tc_choice(scores, layer.correction_bias, layer.top_k, layer.grouped_topk)
    ids = torch.tensor(chosen, dtype=torch.int64)
    weights = scores.gather(1, ids)
    if layer.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * layer.routed_scaling_factor
    return weights.to(logits.device), ids.to(logits.device)


def draw_correction_bias(case: MoECase, logits: torch.Tensor, gen: torch.Generator
                         ) -> torch.Tensor:
    """A correction bias [E] fp32 for a noaux_tc case: of the scores' own spread, so that it
    changes the chosen experts of most tokens (asserted: a runner that ignores it cannot pass),
    and, with groups, such that ranking the groups by their best biased score instead of the
    top-2 sum changes some token's experts too; every choice won by CHOICE_MARGIN (redrawn
    until it is)."""
    scores = reference_scores(logits, case.scoring)
    plain, _ = noaux_tc_choice(scores, None, case.top_k, case.groups)
    spread = (scores.max() - scores.min()).item()
    for _ in range(500):
        bias = torch.randn(case.experts, generator=gen) * spread * 0.25
        chosen, margin = noaux_tc_choice(scores, bias, case.top_k, case.groups)
        if margin < CHOICE_MARGIN:
            continue
        moved = sum(set(a) != set(b) for a, b in zip(chosen, plain, strict=True))
        if 2 * moved < case.tokens:
            continue
        if case.groups is not None and case.groups[1] < case.groups[0]:
            by_max, _ = noaux_tc_choice(scores, bias, case.top_k, case.groups, "max")
            if all(set(a) == set(b) for a, b in zip(chosen, by_max, strict=True)):
                continue
        return bias
    raise AssertionError(f"{case.id}: no correction bias in 500 draws moves the choice with a "
                         f"margin of {CHOICE_MARGIN} (the case is ill-posed)")


def build_inputs(case: MoECase, device: torch.device, seed: int) -> MoEInputs:
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[case.dtype]
    T, E, H, inter = case.tokens, case.experts, case.hidden, case.inter

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    hidden = rand(T, H)
    w13 = rand(E, 2 * inter, H, scale=H ** -0.5).contiguous()
    w2 = rand(E, H, inter, scale=inter ** -0.5).contiguous()
    logits = routing_logits(case, gen).to(dtype)
    correction_bias = None
    if case.correction_bias:  # on the logits as rounded to the compute dtype
        correction_bias = draw_correction_bias(case, logits, gen).to(device)
    logits = logits.to(device)
    shared = rand(T, H, scale=0.5) if case.shared else None
    layer = MoELayerParams(layer_id=0, num_experts=E, top_k=case.top_k, hidden_size=H,
                           intermediate_size=inter, renormalize=case.renormalize,
                           scoring_func=case.scoring, grouped_topk=case.groups,
                           routed_scaling_factor=case.scaling, activation=case.activation,
                           swiglu_limit=case.swiglu_limit, correction_bias=correction_bias)
    extra = {}
    if case.bias:  # fp32, as the contract gives them; large enough to move every output
        extra = {"w13_bias": (torch.randn(E, 2 * inter, generator=gen) * 0.5).to(device),
                 "w2_bias": (torch.randn(E, H, generator=gen) * 0.5).to(device)}
    return MoEInputs(case, hidden, logits, MoEWeights(w13, w2, extra=extra), layer, shared)


def reference_moe(inputs: MoEInputs) -> torch.Tensor:
    """The fp32 ground truth [T, H]: the same routing, every active expert in fp32."""
    layer, w = inputs.layer, inputs.weights
    b13, b2 = w.extra.get("w13_bias"), w.extra.get("w2_bias")
    if layer.correction_bias is not None:  # noaux_tc, written apart from the contract's
        route_w, ids = reference_routing(inputs.logits, layer)
    else:
        route_w, ids = select_experts(inputs.logits, layer.top_k, layer.renormalize,
                                      layer.grouped_topk, layer.scoring_func,
                                      layer.routed_scaling_factor)
    x = inputs.hidden.float()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w.w13[e].float().t()  # [n, 2I]
        if b13 is not None:
            h = h + b13[e].float()
        y = reference_glu(h, layer) @ w.w2[e].float().t()  # [n, H]
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tok, y * route_w[tok, slot, None])
    if inputs.shared is not None:
        out += inputs.shared.float()
    return out


def _check_close(got: torch.Tensor, want: torch.Tensor, case: MoECase, what: str) -> None:
    atol, rtol = TOLERANCES[case.dtype]
    scale = max(want.abs().max().item(), 1e-6)
    torch.testing.assert_close(
        got.float(), want, atol=atol * scale, rtol=rtol,
        msg=lambda m: f"{what} ({case.dtype}, atol={atol:g} x {scale:.3g}, rtol={rtol:g})\n{m}")


def check_result(name: str, case: MoECase, result: torch.Tensor, out: torch.Tensor | None,
                 inputs: MoEInputs) -> None:
    T, H = case.tokens, case.hidden
    if out is not None and result.data_ptr() != out.data_ptr():
        raise AssertionError(f"{name}: given `out`, it must write into it and return it")
    if tuple(result.shape) != (T, H) or result.dtype != inputs.hidden.dtype:
        raise AssertionError(f"{name}: result is {tuple(result.shape)} {result.dtype}, the "
                             f"contract says ({T}, {H}) {inputs.hidden.dtype}")
    if not torch.isfinite(result).all():
        rows = (~torch.isfinite(result)).any(-1).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{name}: non-finite output at tokens {rows} (the poisoned `out` "
                             f"was not fully written)")


def _share(inputs: MoEInputs, rank: int, shares: int) -> MoEInputs:
    """Expert-parallel share `rank` of `shares`: its experts' weights, MoELayerParams saying
    which they are, and the shared output on share 0 only (added once over the shares)."""
    E = inputs.layer.num_experts
    n = E // shares
    w = MoEWeights(inputs.weights.w13[rank * n:(rank + 1) * n].contiguous(),
                   inputs.weights.w2[rank * n:(rank + 1) * n].contiguous(),
                   extra={k: v[rank * n:(rank + 1) * n].contiguous()
                          for k, v in inputs.weights.extra.items()})
    layer = dataclasses.replace(inputs.layer, expert_offset=rank * n, num_local_experts=n)
    return dataclasses.replace(inputs, weights=w, layer=layer,
                               shared=inputs.shared if rank == 0 else None)


def check_ep_case(reg: Registration, case: MoECase, device: torch.device, seed: int = 0
                  ) -> None:
    """An expert-parallel case: every share run alone (into a poisoned `out`), their sum
    equal to the whole layer's fp32 reference."""
    device = torch.device(device)
    inputs = build_inputs(case, device, case.seed(seed))
    runner = reg.load()()
    total = torch.zeros(case.tokens, case.hidden, dtype=torch.float32, device=device)
    for rank in range(case.ep):
        part = _share(inputs, rank, case.ep)
        out = torch.full((case.tokens, case.hidden), float("nan"), dtype=inputs.hidden.dtype,
                         device=device)
        result = runner.forward(part.hidden, part.logits, part.weights, part.layer, part.shared,
                                out=out)
        check_result(f"{reg.name} (expert share {rank} of {case.ep})", case, result, out, part)
        total += result.float()
    _check_close(total, reference_moe(inputs), case,
                 f"{reg.name}: the sum of its {case.ep} expert-parallel shares differs from "
                 f"the fp32 reference")


def check_case(reg: Registration, case: MoECase, device: torch.device, seed: int = 0) -> None:
    """Run `case` on the runner `reg` and check it; AssertionError says what is wrong."""
    if case.ep > 1:
        check_ep_case(reg, case, device, seed)
        return
    device = torch.device(device)
    inputs = build_inputs(case, device, case.seed(seed))
    runner = reg.load()()
    before = [t.clone() for t in (inputs.hidden, inputs.logits, inputs.shared) if t is not None]
    out = torch.full((case.tokens, case.hidden), float("nan"), dtype=inputs.hidden.dtype,
                     device=device)
    result = runner.forward(inputs.hidden, inputs.logits, inputs.weights, inputs.layer,
                            inputs.shared, out=out)
    check_result(reg.name, case, result, out, inputs)
    after = [t for t in (inputs.hidden, inputs.logits, inputs.shared) if t is not None]
    for b, a, what in zip(before, after, ("hidden", "router logits", "shared output"),
                          strict=False):
        if not torch.equal(b, a):
            raise AssertionError(f"{reg.name}: modified its input ({what})")
    want = reference_moe(inputs)
    _check_close(result, want, case, f"{reg.name} output differs from the fp32 reference")
    if case.tokens > 8:  # the no-`out` path once per shape family is enough (and cheap)
        return
    _poison_allocator(case.tokens * case.hidden * 4 * 4, device)
    fresh = runner.forward(inputs.hidden, inputs.logits, inputs.weights, inputs.layer,
                           inputs.shared)
    check_result(reg.name + " (no out)", case, fresh, None, inputs)
    _check_close(fresh, want, case, f"{reg.name} output without `out` differs from the fp32 "
                                    f"reference")


def check_graph_case(reg: Registration, case: MoECase, device: torch.device,
                     seed: int = 0) -> None:
    """Capture one call in a CUDA graph, replay it on a second case's inputs, check both."""
    device = torch.device(device)
    runner = reg.load()()
    first = build_inputs(case, device, case.seed(seed))
    second = build_inputs(case, device, case.seed(seed + 1))
    out = torch.full((case.tokens, case.hidden), float("nan"), dtype=first.hidden.dtype,
                     device=device)
    static = MoEInputs(case, first.hidden.clone(), first.logits.clone(), first.weights,
                       first.layer, None if first.shared is None else first.shared.clone())

    def call() -> torch.Tensor:
        return runner.forward(static.hidden, static.logits, static.weights, static.layer,
                              static.shared, out=out)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        call()  # warm up (compiles kernels) outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for inputs in (first, second):
        static.hidden.copy_(inputs.hidden)
        static.logits.copy_(inputs.logits)
        if static.shared is not None:
            static.shared.copy_(inputs.shared)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        check_result(reg.name + " (graph replay)", case, out, out, inputs)
        # the second inputs share the first's weights
        ref = reference_moe(MoEInputs(case, inputs.hidden, inputs.logits, first.weights,
                                      first.layer, inputs.shared))
        _check_close(out, ref, case, f"{reg.name} graph replay differs from the fp32 reference")
