"""The MoE-runner protocol the MoE layer calls, the per-layer parameters it passes, and the
routing helpers every runner (and the reference) shares.

A runner is built once per model by its factory, called with no arguments; everything it needs
per layer comes with each call. Per MoE layer and step the layer calls

    runner.forward(hidden, router_logits, weights, layer, shared=None, out=None) -> [T, H]

with (T tokens, E experts, H hidden size, I expert intermediate size, k = layer.top_k):
- hidden [T, H], contiguous, in the compute dtype; T >= 1.
- router_logits [T, E], the router's raw output (any float dtype; routing is computed in fp32).
- weights: MoEWeights, the stacked expert weights in the form the quant method gives them.
- layer: MoELayerParams, static per layer (top-k, renormalize, scoring, grouped top-k, ...).
- shared [T, H] or None: the shared experts' output (already gated, as Qwen2-MoE's sigmoid
  gate does), computed by the layer through its quant method; the runner adds it to the routed
  sum (so a fused kernel may add it in its epilogue).
- out [T, H] or None: where to write the result. When given, every element must be written (the
  conformance suite poisons it with NaN) and `out` is returned; otherwise a new tensor.
It returns sum_j w_j * down_e_j(glu(gate_up_e_j(x))) (+ shared) for the k experts e_j and
weights w_j that `route(router_logits, layer)` gives (renormalized when asked, then times
layer.routed_scaling_factor; `shared` is not scaled), in hidden's dtype, where gate_up_e(x) =
x @ w13[e].T (+ b13[e]) is [gate | up] and down_e(h) = h @ w2[e].T (+ b2[e]). glu is
layer.activation (`gated_activation` is its definition): act(gate) * up with act SiLU, or GELU
in its exact erf form (F.gelu's default, not the tanh approximation); or "swigluoai", GPT-OSS's
clamped SwiGLU: gate clamped to at most layer.swiglu_limit, up to [-limit, limit], then
(up + 1) * gate * sigmoid(layer.swiglu_alpha * gate). The expert biases b13 [E, 2I] and b2
[E, H] are there where the weights carry them (MoEWeights.extra "w13_bias" / "w2_bias", any
form; GPT-OSS's): b13 is added before the activation, b2 before the routing weight.

Expert parallelism (a runner declaring `MoECaps.expert_parallel`): `layer.num_local_experts`
set means the weights hold experts [layer.expert_offset, + num_local_experts) only; routing is
still over all E (router_logits [T, E]) and the runner returns the sum of its local experts'
terms (+ shared); the other ranks' terms are added by the layer's all-reduce.

A runner may assume: inputs are not modified by anyone during the call and must not be
modified by it; the weights are on hidden's device; E, H, I and the weight form match the caps it
declared (the resolver checked them). With `MoECaps.cuda_graph` it promises that a decode-sized
call never syncs with the host and allocates only what a CUDA graph can replay (no shape taken
from device values).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from core.contract.quant import div_scalar, reciprocal

SCORING_FUNCS = ("softmax", "sigmoid")
# MoELayerParams.activation: the gated activations a runner may be asked for (gated_activation)
ACTIVATIONS = ("silu", "gelu", "swigluoai")
# GPT-OSS's clamped SwiGLU constants (transformers' GptOssConfig swiglu_alpha / swiglu_limit)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
# MoEWeights.extra keys of the expert biases ([E, 2I] in W13_LAYOUT, [E, H])
BIAS_KEYS = ("w13_bias", "w2_bias")
# w13 layout: rows [0, I) are the gate projection, rows [I, 2I) the up projection.
W13_LAYOUT = "gate_up"


@dataclass(frozen=True)
class MoELayerParams:
    """Static per-layer MoE parameters (set by the model, read by runners)."""

    layer_id: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    # divide the k selected weights by their sum (norm_topk_prob). With softmax scores this is
    # also GPT-OSS's routing, a softmax over the k best logits: exp(l_i) / sum_k exp(l_j) either
    # way (the same experts too: softmax keeps the logits' order)
    renormalize: bool = True
    scoring_func: str = "softmax"  # softmax over all experts, or an independent sigmoid each
    # DeepSeek-style group-limited routing: (num_groups, topk_groups); None = no groups
    grouped_topk: tuple[int, int] | None = None
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (after renormalize;
    # not the shared experts' output): DeepSeek-V3's 2.5; the conformance suite checks it
    # act(gate) * up: "silu", or "gelu" = the exact erf form, F.gelu(x, approximate="none")
    # (0.5 x (1 + erf(x / sqrt 2))); tanh's approximation is not "gelu". Or "swigluoai"
    # (GPT-OSS): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
    # with the two constants below (read only for it). See gated_activation.
    activation: str = "silu"
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT
    # Expert parallelism (a runner with MoECaps.expert_parallel): the weights hold experts
    # [expert_offset, expert_offset + num_local_experts) only; routing is over all
    # num_experts, and the runner sums only its local experts' terms (the other ranks add
    # theirs; `shared`, when given, is added once, here). None: every expert is local.
    expert_offset: int = 0
    num_local_experts: int | None = None
    # DeepSeek-V3's noaux_tc routing: a per-expert bias [E] fp32 (the checkpoint's
    # e_score_correction_bias) added to the scores to choose the experts (and, with groups, to
    # rank each group by the sum of its two best biased scores); the weights are the unbiased
    # scores. None: experts (and groups, by their best score) chosen on the scores themselves.
    correction_bias: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, not "
                             f"{self.activation!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, not "
                             f"{self.scoring_func!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts}")
        local = self.num_local_experts
        if local is not None and not (0 <= self.expert_offset and local >= 1
                                      and self.expert_offset + local <= self.num_experts):
            raise ValueError(f"local experts [{self.expert_offset}, +{local}) are not within "
                             f"the {self.num_experts} experts")


@dataclass(frozen=True)
class MoEWeights:
    """The stacked expert weights of one layer, as the quant method created them.

    form "unquantized": w13 [E, 2I, H] (layout W13_LAYOUT: gate rows, then up rows), w2 [E, H, I],
    both in the compute dtype, contiguous. form "fp8" (the fp8 quant method): w13 / w2 in e4m3,
    extra "w13_scale" / "w2_scale" fp32, per output channel [E, N, 1] or per block
    [E, N/bn, K/bk] with extra "block" = tensor([bn, bk]); real W = stored * scale, and the
    activations are quantized to e4m3 per token (per channel) or per bk inputs (per block), as
    the fp8 linear layers do. Other forms (a quant method's name) carry their packed tensors in
    w13 / w2 and scales or zero points in `extra`, as that method documents.

    Expert biases, in any form (GPT-OSS's experts have them): extra "w13_bias" [E, 2I] (rows in
    W13_LAYOUT: the gate's, then the up's) and "w2_bias" [E, H], both or neither, fp32 (E: the
    local experts under expert parallelism). A runner adds them (see the
    module doc) only if its caps declare MoECaps.expert_bias; the resolver refuses the others.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    form: str = "unquantized"
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a copy, read-only by contract (a mappingproxy would make models unpicklable)
        object.__setattr__(self, "extra", dict(self.extra))


class MoERunner(ABC):
    """One MoE implementation: routing plus the experts' gated MLPs, in one forward."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, weights: MoEWeights,
                layer: MoELayerParams, shared: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H] in hidden's dtype (see the module doc)."""


# ---- the experts' activation and biases -------------------------------------------------------

def gated_activation(gate_up: torch.Tensor, layer: MoELayerParams) -> torch.Tensor:
    """[n, 2I] = [gate | up] -> [n, I] in gate_up's dtype: layer.activation's definition (the
    one every runner computes; conformance.moe_check holds an independent reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if layer.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if layer.activation == "gelu":
        return torch.nn.functional.gelu(gate, approximate="none") * up
    if layer.activation == "swigluoai":  # transformers' GptOssExperts._apply_gate
        limit = layer.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * layer.swiglu_alpha))
    raise ValueError(f"unknown activation {layer.activation!r} (known: {ACTIVATIONS})")


def expert_biases(weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w13_bias [E, 2I], w2_bias [E, H]) where the weights carry expert biases, else None;
    ValueError for one without the other."""
    b13, b2 = (weights.extra.get(k) for k in BIAS_KEYS)
    if b13 is None and b2 is None:
        return None
    if b13 is None or b2 is None:
        raise ValueError("expert biases come in pairs: w13_bias and w2_bias, or neither")
    return b13, b2


# ---- routing ----------------------------------------------------------------------------------

def expert_scores(router_logits: torch.Tensor, scoring_func: str = "softmax") -> torch.Tensor:
    """router_logits [T, E] -> per-expert scores [T, E] fp32 (softmax over E, or sigmoid)."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring function {scoring_func!r} (known: {SCORING_FUNCS})")


def limit_to_groups(scores: torch.Tensor, num_groups: int, topk_groups: int,
                    top2_sum: bool = False) -> torch.Tensor:
    """Grouped top-k: experts split into `num_groups` equal groups, each scored by its best
    expert (or, top2_sum, by the sum of its two best: DeepSeek-V3's noaux_tc); experts outside
    the best `topk_groups` groups get score 0, or -inf with top2_sum (biased scores may be
    negative); never selected before an eligible one. scores [T, E] -> [T, E]."""
    T, E = scores.shape
    if E % num_groups:
        raise ValueError(f"{E} experts do not split into {num_groups} groups")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups {topk_groups} must be in 1..{num_groups}")
    grouped = scores.view(T, num_groups, E // num_groups)
    if top2_sum:
        group_scores = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    return scores.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1),
                              float("-inf") if top2_sum else 0.0)


def renormalized(weights: torch.Tensor) -> torch.Tensor:
    """The k selected weights [T, k] divided by their sum (norm_topk_prob)."""
    return weights / weights.sum(dim=-1, keepdim=True)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
                   grouped_topk: tuple[int, int] | None = None, scoring_func: str = "softmax",
                   routed_scaling_factor: float = 1.0,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: (weights [T, k] fp32, expert ids [T, k] int64), best expert first.

    Scores (softmax or sigmoid, fp32), optionally limited to the best expert groups, then the k
    best experts; their weights are the scores, renormalized to sum 1 when asked, then scaled.
    With a correction bias [E] (noaux_tc) the choice (groups ranked by their top-2 sum, then
    experts) is made on scores + bias, and the weights are the chosen experts' unbiased scores.
    No host sync: usable inside a CUDA graph.
    """
    scores = expert_scores(router_logits, scoring_func)
    if correction_bias is not None:
        choice = scores + correction_bias.float()
        if grouped_topk is not None:
            choice = limit_to_groups(choice, *grouped_topk, top2_sum=True)
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        if grouped_topk is not None:
            scores = limit_to_groups(scores, *grouped_topk)
        weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = renormalized(weights)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def route(router_logits: torch.Tensor, layer: MoELayerParams
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` with one layer's parameters."""
    return select_experts(router_logits, layer.top_k, layer.renormalize, layer.grouped_topk,
                          layer.scoring_func, layer.routed_scaling_factor,
                          layer.correction_bias)


# ---- form "fp8" (see MoEWeights): reference dequantization for runners ----------------------

def fp8_expert(weights: MoEWeights, which: str, expert: int) -> torch.Tensor:
    """The real fp32 weight of one expert's w13 or w2 from form "fp8": stored * scale."""
    w = getattr(weights, which)[expert].float()
    scale = weights.extra[f"{which}_scale"][expert].float()
    block = weights.extra.get("block")
    if block is not None:
        bn, bk = (int(b) for b in block.tolist())
        scale = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:w.shape[0], :w.shape[1]]
    return w * scale


def fp8_fake_quant_input(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """x [T, K] as form "fp8" quantizes it, dequantized to fp32: e4m3 with one scale per token,
    or per `bk` inputs of a token for block weights (amax / 448, correctly rounded on every
    device: CUDA's division by a Python float is a reciprocal multiply, see
    core.contract.quant.div_scalar), each input times the scale's correctly rounded reciprocal
    (core.contract.quant.reciprocal, the kernels' rounding)."""
    x = x.float()
    block = weights.extra.get("block")
    group = int(block[1]) if block is not None else x.shape[1]
    t, k = x.shape
    pad = (-k) % group
    g = torch.nn.functional.pad(x, (0, pad)).view(t, -1, group)
    s = div_scalar(g.abs().amax(-1, keepdim=True).clamp(min=1e-12), 448.0)
    q = (g * reciprocal(s)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return q.view(t, -1)[:, :k]
