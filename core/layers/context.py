"""What every layer is built with: compute dtype, device, quant method, MoE runner, layer ops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.engine.distributed import SINGLE, TPGroup
from core.layers.linear import UnquantizedLinearMethod
from core.layers.ops_ref import TorchLayerOps

if TYPE_CHECKING:
    from core.contract.layer_ops import CompleteLayerOps


@dataclass(frozen=True)
class ModelContext:
    """Construction-time context passed to a model class and down to its layers.

    quant_method: creates / post-processes / applies linear weights (the `unquantized` method's
    instance by default). moe_runner: the chosen MoE runner instance (None for dense models).
    ops: the layer ops (core.contract.layer_ops; the PyTorch reference by default), every op provided.
    tp: this rank's tensor-parallel group (core.engine.distributed; one rank by default): layers built
    with it hold this rank's slice and reduce or gather across ranks where the math needs it.
    """

    dtype: torch.dtype = torch.float32
    device: torch.device | None = None  # None: torch's default device
    quant_method: object = field(default_factory=UnquantizedLinearMethod)
    moe_runner: object | None = None
    ops: CompleteLayerOps = field(default_factory=TorchLayerOps)
    tp: TPGroup = SINGLE
