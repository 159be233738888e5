"""Qwen3: Llama with RMSNorm over each q and k head before rotary, explicit head_dim."""

from __future__ import annotations

from plugins.models.llama import LlamaForCausalLM
from plugins.models.qwen2 import layer_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sliding_window = staticmethod(layer_sliding_window)
