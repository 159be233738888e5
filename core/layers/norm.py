"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from core.layers import triton_ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like HF Llama, cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; same math as below when nothing needs casting.
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def _fused(self) -> bool:
        return triton_ops.usable_for(self.weight)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """norm(x) as a plain callable (hot path: no module call, no attribute lookups)."""
        if self._fused():
            return partial(triton_ops.rms_norm, weight=self.weight, eps=self.eps)
        if self.weight.dtype == torch.float32:
            return partial(F.rms_norm, normalized_shape=(self.hidden_size,), weight=self.weight,
                           eps=self.eps)
        return self._norm

    def bound_add(self) -> Callable[[torch.Tensor, torch.Tensor],
                                    tuple[torch.Tensor, torch.Tensor]]:
        """(x, residual) -> (norm(x + residual), x + residual) as a plain callable; one kernel
        on a GPU (core.layers.triton_ops)."""
        if self._fused():
            return partial(triton_ops.add_rms_norm, weight=self.weight, eps=self.eps)
        norm = self.bound()

        def add_norm(x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
            total = x + residual
            return norm(total), total

        return add_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.bound()(x)
        if x.dim() == 2 and self._fused():
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self._norm(x), x
