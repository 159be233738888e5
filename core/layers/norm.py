"""RMSNorm, optionally fused with the residual add that precedes it (and, Gemma's sandwich, with
the norm before that add)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.layers.ops_ref import TorchLayerOps, compose_norm_add_norm, rms_norm

if TYPE_CHECKING:
    from core.contract.layer_ops import CompleteLayerOps


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like HF Llama, cast back before the weight.

    The computation is the layer ops' (core.contract.layer_ops, given at build time; the PyTorch reference
    when none are given): `bound()` / `bound_add()` / `bound_add_norm()` ask them once for the
    callables."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, ops: CompleteLayerOps | None = None):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.ops = ops if ops is not None else TorchLayerOps()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """norm(x) as a plain callable (hot path: no module call, no attribute lookups)."""
        return self.ops.rms_norm(self.weight, self.eps)

    def bound_add(self) -> Callable[[torch.Tensor, torch.Tensor],
                                    tuple[torch.Tensor, torch.Tensor]]:
        """(x, residual) -> (norm(x + residual), x + residual) as a plain callable (one kernel
        where the layer ops fuse it)."""
        return self.ops.add_rms_norm(self.weight, self.eps)

    def bound_add_norm(self, then: RMSNorm) -> Callable[[torch.Tensor, torch.Tensor],
                                                        tuple[torch.Tensor, torch.Tensor]]:
        """(h, residual) -> (then(residual + norm(h)), residual + norm(h)) as a plain callable:
        this norm, the residual add and the next norm `then` (Gemma's post-attention norm and
        pre-MLP norm), one kernel where the layer ops fuse them; the same numbers as
        `bound()` followed by `then.bound_add()`."""
        fused = getattr(self.ops, "norm_add_norm", None)  # optional: ops written before it
        if fused is None or then.eps != self.eps:  # the fused op takes one eps
            return compose_norm_add_norm(self.bound(), then.bound_add())
        return fused(self.weight, then.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.bound()(x)
        return self.bound_add()(x, residual)
