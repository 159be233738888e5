"""`torch_native` MoE runner: top-k routing and a per-expert loop over the tokens routed to it."""

from __future__ import annotations

import torch

from core.contract.moe import (
    MoELayerParams,
    MoERunner,
    MoEWeights,
    fp8_expert,
    fp8_fake_quant_input,
    route,
    select_experts,
)
from core.layers.activation import get_act_fn

__all__ = ["TorchNativeMoE", "select_experts"]


class TorchNativeMoE(MoERunner):
    """The reference MoE runner: correct on any device, one small GEMM pair per active expert.

    Accumulates in fp32. Not graph safe: the set of active experts is read on the host.
    """

    def __init__(self, *args, **kwargs):
        pass

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, weights: MoEWeights,
                layer: MoELayerParams, shared: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if weights.form not in ("unquantized", "fp8"):
            raise ValueError(f"torch_native runs unquantized and fp8 experts, not {weights.form}")
        act = get_act_fn(layer.activation)
        w13, w2 = weights.w13, weights.w2
        route_w, ids = route(router_logits, layer)
        acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        first = layer.expert_offset  # expert parallel: this rank's experts only
        last = first + (layer.num_local_experts or layer.num_experts)
        # One host sync for the set of active experts, then no more.
        for g in ids.unique().tolist():
            if not first <= g < last:
                continue  # another rank's expert
            e = g - first  # its index in this rank's weights
            tok, slot = (ids == g).nonzero(as_tuple=True)
            x = hidden[tok]  # [n, H]
            if weights.form == "fp8":  # W8A8 in fp32: dequantized expert, fake-quantized x
                gate, up = (fp8_fake_quant_input(x, weights)
                            @ fp8_expert(weights, "w13", e).t()).chunk(2, dim=-1)
                h = (act(gate) * up).to(hidden.dtype)
                y = fp8_fake_quant_input(h, weights) @ fp8_expert(weights, "w2", e).t()
            else:
                gate, up = (x @ w13[e].t()).chunk(2, dim=-1)  # [n, I] each
                y = (act(gate) * up) @ w2[e].t()  # [n, H]
            acc.index_add_(0, tok, y.float() * route_w[tok, slot].unsqueeze(1))
        if shared is not None:
            acc += shared.float()
        if out is None:
            return acc.to(hidden.dtype)
        out.copy_(acc)
        return out
