"""Gated activations over a stacked [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.layers import triton_ops

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act_fn(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(_ACTS)})")
    return _ACTS[name]


class GatedAct(nn.Module):
    """act(gate) * up, where x = [gate | up] along the last dim: [T, 2I] -> [T, I]."""

    def __init__(self, act: str = "silu"):
        super().__init__()
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu and x.dim() == 2 and x.is_cuda and triton_ops.usable_for(x):
            return triton_ops.silu_and_mul(x)  # one kernel instead of three
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
