"""A mixture-of-experts layer: router in PyTorch, experts delegated to the chosen MoE runner."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from core.layers.linear import Linear, UnquantizedLinearMethod

# HF expert projection names -> our stacked tensors (w13 = [gate | up], w2 = down).
_SHARDS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
           "down_proj": ("w2", None), "w2": ("w2", None)}


class MoE(nn.Module):
    """hidden [T, H] -> [T, H]: router logits [T, E], then `ctx.moe_runner.forward(...)`.

    Weights: w13_weight [E, 2I, H], w2_weight [E, H, I] (created by the quant method).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ctx, renormalize: bool = True, activation: str = "silu",
                 grouped_topk: tuple[int, int] | None = None, router_bias: bool = False):
        super().__init__()
        if ctx.moe_runner is None:
            raise ValueError("this model has MoE layers but no MoE runner was chosen")
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.activation = activation
        self.grouped_topk = grouped_topk
        self.runner = ctx.moe_runner
        # The router stays dense whatever the experts' quantization.
        self.gate = Linear(hidden_size, num_experts, router_bias,
                           replace(ctx, quant_method=UnquantizedLinearMethod()))
        self.quant_method = ctx.quant_method
        self.quant_method.create_moe_weights(self, num_experts, hidden_size, intermediate_size,
                                             ctx.dtype, ctx.device)

    def expert_weight_loader(self, loaded: torch.Tensor, expert_id: int, proj: str) -> None:
        """Place one HF expert projection (gate_proj/up_proj/down_proj or w1/w3/w2)."""
        if proj not in _SHARDS:
            raise KeyError(f"unknown expert projection {proj!r}")
        name, half = _SHARDS[proj]
        target = getattr(self, f"{name}_weight").data[expert_id]
        if half is not None:
            i = self.intermediate_size
            target = target[half * i:(half + 1) * i]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"expert {expert_id} {proj}: expected shape {tuple(target.shape)}, "
                             f"got {tuple(loaded.shape)}")
        target.copy_(loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        return self.runner.forward(hidden, router_logits, self.w13_weight, self.w2_weight,
                                   self.top_k, self.renormalize, activation=self.activation,
                                   grouped_topk=self.grouped_topk)
