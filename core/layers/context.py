"""What every layer is built with: compute dtype, device, quant method and MoE runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.layers.linear import UnquantizedLinearMethod


@dataclass(frozen=True)
class ModelContext:
    """Construction-time context passed to a model class and down to its layers.

    quant_method: creates / post-processes / applies linear weights (the `unquantized` method's
    instance by default). moe_runner: the chosen MoE runner instance (None for dense models).
    """

    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quant_method: object = field(default_factory=UnquantizedLinearMethod)
    moe_runner: object | None = None
