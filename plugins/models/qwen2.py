"""Qwen2: Llama with biases on q/k/v (not on o) and optional per-layer sliding windows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugins.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def layer_sliding_window(config: PretrainedConfig, layer_id: int) -> int | None:
    """The window of one layer per HF `layer_types` (or use_sliding_window/max_window_layers)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    if not getattr(config, "use_sliding_window", False):
        return None
    return window if layer_id >= getattr(config, "max_window_layers", 0) else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_bias(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False

    sliding_window = staticmethod(layer_sliding_window)
