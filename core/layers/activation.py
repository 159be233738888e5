"""Gated activations over a stacked [gate | up] projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from core.contract.layer_ops import LayerOps

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# the gelu activations the layer ops' gelu_and_mul fuses, by torch's `approximate`
_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


def get_act_fn(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(_ACTS)})")
    return _ACTS[name]


class GatedAct(nn.Module):
    """act(gate) * up, where x = [gate | up] along the last dim: [T, 2I] -> [T, I].

    SiLU runs through the layer ops' silu_and_mul, GELU (erf or tanh form) through their
    gelu_and_mul (one kernel where they fuse it)."""

    def __init__(self, act: str = "silu", ops: LayerOps | None = None):
        super().__init__()
        self.act = get_act_fn(act)
        self._fused = None
        if ops is not None and act == "silu":
            self._fused = ops.silu_and_mul()
        elif ops is not None and act in _GELU and hasattr(ops, "gelu_and_mul"):
            self._fused = ops.gelu_and_mul(_GELU[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and x.dim() == 2:
            return self._fused(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
