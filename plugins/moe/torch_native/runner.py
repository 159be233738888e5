"""`torch_native` MoE runner: top-k routing and a per-expert loop over the tokens routed to it."""

from __future__ import annotations

import torch

from core.layers.activation import get_act_fn


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   grouped_topk: tuple[int, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: (weights [T, k] fp32, expert ids [T, k] int64).

    grouped_topk = (num_groups, topk_groups): DeepSeek-V2-style group-limited routing; experts
    are split into equal groups, each group scored by its best expert, and only the best
    `topk_groups` groups stay eligible.
    """
    scores = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if grouped_topk is not None:
        num_groups, topk_groups = grouped_topk
        T, E = scores.shape
        if E % num_groups:
            raise ValueError(f"{E} experts do not split into {num_groups} groups")
        group_scores = scores.view(T, num_groups, E // num_groups).amax(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        expert_keep = keep.repeat_interleave(E // num_groups, dim=1)  # [T, E]
        scores = scores.masked_fill(~expert_keep, 0.0)
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TorchNativeMoE:
    """The reference MoE runner: correct on any device, one small GEMM pair per active expert."""

    def __init__(self, *args, **kwargs):
        pass

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, top_k: int, renormalize: bool, activation: str = "silu",
                grouped_topk: tuple[int, int] | None = None) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E], w13 [E, 2I, H] (gate | up), w2 [E, H, I]."""
        act = get_act_fn(activation)
        weights, ids = select_experts(router_logits, top_k, renormalize, grouped_topk)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        # One host sync for the set of active experts, then no more.
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            x = hidden[tok]  # [n, H]
            gate, up = (x @ w13[e].t()).chunk(2, dim=-1)  # [n, I] each
            y = (act(gate) * up) @ w2[e].t()  # [n, H]
            out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(1))
        return out.to(hidden.dtype)
