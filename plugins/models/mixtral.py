"""Mixtral: Mistral's decoder (the window, if configured, on every layer) with an expert block
on every layer: softmax top-k routing renormalized over the chosen experts, no shared expert.
Checkpoint names `block_sparse_moe.gate` / `block_sparse_moe.experts.E.w1|w2|w3`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugins.models.llama import LlamaForCausalLM
from plugins.models.mistral import MistralForCausalLM
from plugins.models.qwen2_moe import Qwen2MoeForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralForCausalLM(Qwen2MoeForCausalLM):
    attention_bias = staticmethod(LlamaForCausalLM.attention_bias)
    sliding_window = staticmethod(MistralForCausalLM.sliding_window)

    @staticmethod
    def moe_layers(config: PretrainedConfig) -> tuple[int, ...]:
        return tuple(range(config.num_hidden_layers))

    @staticmethod
    def num_experts(config: PretrainedConfig) -> int:
        return config.num_local_experts

    @staticmethod
    def renormalize(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def shared_intermediate_size(config: PretrainedConfig) -> int | None:
        return None
