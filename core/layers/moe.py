"""A mixture-of-experts layer: router in PyTorch, experts delegated to the chosen MoE runner
(the protocol is core.contract.moe)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from core.contract.moe import BIAS_KEYS, SWIGLU_ALPHA, SWIGLU_LIMIT, MoELayerParams, MoEWeights
from core.engine.distributed import SINGLE
from core.layers.linear import DenseLinearMethod, Linear, tp_narrow

# HF expert projection names -> our stacked tensors (w13 = [gate | up], w2 = down).
_SHARDS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
           "down_proj": ("w2", None), "w2": ("w2", None)}
# Fused checkpoints (transformers >= 5 in memory, some exports): all experts in one tensor.
FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


class MoE(nn.Module):
    """hidden [T, H] -> [T, H]: router logits [T, E], then `ctx.moe_runner.forward(...)`.

    Weights: w13_weight [E, 2I, H], w2_weight [E, H, I] (created by the quant method); the
    router is `gate` (dense whatever the experts' quantization; with router_bias, a Linear with
    a bias: GPT-OSS's). expert_bias (GPT-OSS): w13_bias [E, 2I] (gate | up, as w13's rows) and
    w2_bias [E, H], fp32, handed to the runner in MoEWeights.extra whatever the quant method's
    form (a method that creates them itself, beside its packed experts, keeps its own).

    Tensor parallelism (ctx.tp): every rank holds every expert's slice [i0, i0 + I / tp) of the
    intermediate dim (gate and up rows, down columns), routes all tokens alike (the router is
    replicated), and the ranks' partial outputs are summed with one all-reduce (a shared
    expert's partial output, added by the runner before it, is summed with them). With
    expert parallelism (ctx.tp.ep) a rank instead holds experts [e0, e0 + E / tp) whole, the
    runner computes only their terms (MoELayerParams.expert_offset), and the same all-reduce
    sums the ranks' terms: every rank holds every token after the attention's all-reduce, so
    no all-to-all is needed. Expert biases split the same way: w13_bias by the rank's rows;
    w2_bias, added once per token and expert, is held by rank 0 only under the intermediate
    split (zero elsewhere, so that the all-reduce adds it once), by its experts' rank under EP.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ctx, renormalize: bool = True, activation: str = "silu",
                 grouped_topk: tuple[int, int] | None = None, router_bias: bool = False,
                 scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 layer_id: int = 0, correction_bias: bool = False, expert_bias: bool = False,
                 swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT):
        super().__init__()
        if ctx.moe_runner is None:
            raise ValueError("this model has MoE layers but no MoE runner was chosen")
        self.tp = getattr(ctx, "tp", SINGLE)
        self.full_intermediate_size = intermediate_size
        self._i_part = self._e_part = None
        if self.tp.active and self.tp.ep:
            self._e_part = self.tp.split(num_experts, "experts")
        elif self.tp.active:
            self._i_part = self.tp.split(intermediate_size, "MoE intermediate size")
            intermediate_size = self._i_part[1]
        e0, local = self._e_part or (0, None)
        # noaux_tc routing (DeepSeek-V3): the checkpoint's per-expert bias, fp32, loaded in
        # place (the params below hold this tensor)
        bias = None
        if correction_bias:
            bias = self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32, device=ctx.device),
                requires_grad=False)
        self.params = MoELayerParams(
            layer_id=layer_id, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
            intermediate_size=intermediate_size, renormalize=renormalize,
            scoring_func=scoring_func, grouped_topk=grouped_topk,
            routed_scaling_factor=routed_scaling_factor, activation=activation,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
            expert_offset=e0, num_local_experts=local, correction_bias=bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.runner = ctx.moe_runner
        self.gate = Linear(hidden_size, num_experts, router_bias,
                           replace(ctx, quant_method=DenseLinearMethod()))
        # Not named `quant_method`: that is a Linear's. The quant method's MoE duties
        # (core.contract.quant.QuantMethod): create_moe_weights, process_moe_weights_after_loading
        # and moe_weights(layer) -> MoEWeights (None: the dense form).
        self.expert_quant_method = ctx.quant_method
        self.expert_quant_method.create_moe_weights(self, local or num_experts, hidden_size,
                                                    intermediate_size, ctx.dtype, ctx.device)
        self.expert_bias = expert_bias
        if expert_bias:
            for name, n in zip(BIAS_KEYS, (2 * intermediate_size, hidden_size), strict=True):
                if not hasattr(self, name):  # a quant method may have made its own
                    setattr(self, name, nn.Parameter(torch.zeros(
                        local or num_experts, n, dtype=torch.float32, device=ctx.device),
                        requires_grad=False))
        self._weights: MoEWeights | None = None
        self._gate = None

    # ---- loading (a model's load_weights calls weight_loader / param_shards) ----

    def param_shards(self, param: str) -> list[str] | None:
        """The pieces a checkpoint fills of one of our parameters, for the loader's accounting:
        one per expert and projection ("3.gate", "3.up" of w13_*; "3.down" of w2_*), for the
        weights and whatever a quant method adds beside them (w13_weight_scale_inv, ...)."""
        if param.startswith("w13_"):
            return [f"{e}.{p}" for e in range(self.num_experts) for p in ("gate", "up")]
        if param.startswith("w2_"):
            return [f"{e}.down" for e in range(self.num_experts)]
        return None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        """Copy one expert's projection (shard "3.gate" / "3.up" / "3.down") or, with no
        shard, a fused tensor holding every expert ([E, 2I, H] gate|up, or [E, H, I] down)."""
        loaded = self._tp_part(param, loaded, shard)
        if shard is None:
            target = param.data
        else:
            expert, proj = shard.split(".")
            expert = int(expert)
            if self._e_part is not None:  # expert parallel: only this rank's experts
                e0, local = self._e_part
                if not e0 <= expert < e0 + local:
                    return  # another rank's (the loader still counts it as given)
                expert -= e0
            target = param.data[expert]
            if proj in ("gate", "up"):  # rows of [gate | up], in the tensor's output grain
                per = getattr(param, "quant_out_per_row", 1)
                i = self.intermediate_size
                if i % per:
                    raise ValueError(f"intermediate size {i} is not a multiple of {per} "
                                     "(the tensor's output grain)")
                half = 0 if proj == "gate" else 1
                target = target[half * i // per:(half + 1) * i // per]
        if tuple(target.shape) != tuple(loaded.shape):
            if target.numel() != loaded.numel() or target.numel() != 1:
                raise ValueError(f"expected shape {tuple(target.shape)}, got "
                                 f"{tuple(loaded.shape)}")
            loaded = loaded.reshape(target.shape)  # a scalar scale saved as [] or [1]
        target.copy_(loaded)

    def _tp_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None
                 ) -> torch.Tensor:
        """This rank's intermediate slice of one expert's projection, or of a fused tensor
        of every expert (gate | up stacked on dim 1 of w13; down's inputs on w2's last dim);
        under expert parallelism, a fused tensor's experts of this rank."""
        if self.tp.size == 1:
            return loaded
        if param is getattr(self, "e_score_correction_bias", None):
            return loaded  # the router's, over all experts: replicated like the router
        if self._e_part is not None:
            return loaded if shard is not None else loaded.narrow(0, *self._e_part)
        if self._i_part is None:
            return loaded
        i0, n = self._i_part
        if shard is not None:
            proj = shard.split(".")[1]
            if param is getattr(self, "w2_bias", None):  # one expert's [H]: added by rank 0
                return loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
            return tp_narrow(loaded, 0 if proj in ("gate", "up") else 1, i0, n)
        if param is self.w13_weight or param is getattr(self, "w13_bias", None):  # [E, 2I, ...]
            full = self.full_intermediate_size
            return torch.cat([loaded.narrow(1, i0, n), loaded.narrow(1, full + i0, n)], dim=1)
        if param is self.w2_weight:  # [E, H, I]
            return loaded.narrow(2, i0, n)
        if param is getattr(self, "w2_bias", None):  # [E, H]: added once, by rank 0
            return loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
        raise ValueError("only dense expert weights can be split for tensor parallelism")

    def expert_weight_loader(self, loaded: torch.Tensor, expert_id: int, proj: str) -> None:
        """Place one HF expert projection (gate_proj/up_proj/down_proj or w1/w3/w2)."""
        if proj not in _SHARDS:
            raise KeyError(f"unknown expert projection {proj!r}")
        name, half = _SHARDS[proj]
        part = "down" if name == "w2" else ("gate", "up")[half]
        try:
            self.weight_loader(getattr(self, f"{name}_weight"), loaded, f"{expert_id}.{part}")
        except ValueError as exc:
            raise ValueError(f"expert {expert_id} {proj}: {exc}") from exc

    def reset_bindings(self) -> None:
        self._weights = None  # the quant method may have replaced the tensors
        self._gate = None

    # ---- compute ----

    def weights(self) -> MoEWeights:
        if self._weights is None:
            own = self.expert_quant_method.moe_weights(self)
            weights = own if own is not None else MoEWeights(self.w13_weight, self.w2_weight)
            if self.expert_bias and any(k not in weights.extra for k in BIAS_KEYS):
                weights = replace(weights, extra={
                    **weights.extra, **{k: getattr(self, k) for k in BIAS_KEYS}})
            self._weights = weights
        return self._weights

    def forward(self, hidden: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H] (+ the shared experts' output [T, H]) -> [T, H]."""
        gate = self._gate
        if gate is None:  # the router's bound product (the layer ops' few-row kernel, where any)
            gate = self._gate = self.gate.bound()
        router_logits = gate(hidden)  # [T, E]
        out = self.runner.forward(hidden, router_logits, self.weights(), self.params, shared)
        return self.tp.all_reduce(out) if self.tp.active else out
