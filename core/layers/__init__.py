"""Shared model layers: pure PyTorch, vendor-agnostic; kernels come in through ctx / the batch."""

from core.layers.activation import GatedAct, get_act_fn
from core.layers.attention import PagedAttention
from core.layers.context import ModelContext
from core.layers.embedding import LMHead, VocabEmbedding
from core.layers.linear import Linear, UnquantizedLinearMethod, process_weights_after_loading
from core.layers.moe import MoE
from core.layers.norm import RMSNorm
from core.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

__all__ = [
    "GatedAct", "get_act_fn", "PagedAttention", "ModelContext", "LMHead", "VocabEmbedding",
    "Linear", "UnquantizedLinearMethod", "process_weights_after_loading", "MoE", "RMSNorm",
    "RotaryEmbedding", "apply_rotary", "rope_parameters",
]
