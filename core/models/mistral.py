"""Mistral: Llama with a sliding attention window on every layer (config.sliding_window)."""

from __future__ import annotations

from transformers import PretrainedConfig

from core.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config: PretrainedConfig, layer_id: int) -> int | None:
        # HF Mistral: the key at distance d from the query is visible iff d < sliding_window.
        return getattr(config, "sliding_window", None) or None
