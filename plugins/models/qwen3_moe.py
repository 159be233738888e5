"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen2-MoE's expert blocks without a shared
expert, RMSNorm over each q and k head before rotary, the window (if any) on every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugins.models.llama import LlamaForCausalLM
from plugins.models.mistral import MistralForCausalLM
from plugins.models.qwen2_moe import Qwen2MoeForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True
    attention_bias = staticmethod(LlamaForCausalLM.attention_bias)
    # transformers' Qwen3-MoE applies config.sliding_window (None unless use_sliding_window)
    # to every layer, as Mistral does.
    sliding_window = staticmethod(MistralForCausalLM.sliding_window)

    @staticmethod
    def shared_intermediate_size(config: PretrainedConfig) -> int | None:
        return None
