"""`torch_native` MoE runner: top-k routing and a per-expert loop over the tokens routed to it."""

from __future__ import annotations

import torch

from core.contract.moe import (
    MoELayerParams,
    MoERunner,
    MoEWeights,
    expert_biases,
    fp8_expert,
    fp8_fake_quant_input,
    gated_activation,
    route,
    select_experts,
)
from plugins._kit import mxfp4

__all__ = ["TorchNativeMoE", "select_experts"]


class TorchNativeMoE(MoERunner):
    """The reference MoE runner: correct on any device, one small GEMM pair per active expert.

    Accumulates in fp32. Not graph safe: the set of active experts is read on the host.
    Expert biases (GPT-OSS) are added in fp32 to each product, before the activation and
    before the routing weight.
    """

    def __init__(self, *args, **kwargs):
        pass

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, weights: MoEWeights,
                layer: MoELayerParams, shared: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if weights.form not in ("unquantized", "fp8", "mxfp4"):
            raise ValueError("torch_native runs unquantized, fp8 and mxfp4 experts, not "
                             f"{weights.form}")
        w13, w2 = weights.w13, weights.w2
        biases = expert_biases(weights)
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
                gate_up = fp8_fake_quant_input(x, weights) @ fp8_expert(weights, "w13", e).t()
                if biases is not None:
                    gate_up = gate_up + biases[0][e].float()
                h = gated_activation(gate_up, layer).to(hidden.dtype)
                y = fp8_fake_quant_input(h, weights) @ fp8_expert(weights, "w2", e).t()
            elif weights.form == "mxfp4":  # weight-only: this expert dequantized, fp32 products
                gate_up = x.float() @ mxfp4_expert(weights, "w13", e).t()
                if biases is not None:
                    gate_up = gate_up + biases[0][e].float()
                h = gated_activation(gate_up, layer).to(hidden.dtype)
                y = h.float() @ mxfp4_expert(weights, "w2", e).t()
            elif biases is not None:  # the products in fp32, each with its bias
                gate_up = (x @ w13[e].t()).float() + biases[0][e].float()  # [n, 2I]
                h = gated_activation(gate_up, layer).to(hidden.dtype)
                y = (h @ w2[e].t()).float()  # [n, H]
            else:
                y = gated_activation(x @ w13[e].t(), layer) @ w2[e].t()  # [n, H]
            if biases is not None:
                y = y.float() + biases[1][e].float()
            acc.index_add_(0, tok, y.float() * route_w[tok, slot].unsqueeze(1))
        if shared is not None:
            acc += shared.float()
        if out is None:
            return acc.to(hidden.dtype)
        out.copy_(acc)
        return out


def mxfp4_expert(weights: MoEWeights, which: str, expert: int) -> torch.Tensor:
    """One expert's w13 or w2 of form "mxfp4" (plugins/_kit/mxfp4), dequantized to fp32."""
    return mxfp4.dequantize(getattr(weights, which)[expert],
                            weights.extra[f"{which}_scale"][expert])
