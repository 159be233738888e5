"""Mistral: Llama with a sliding attention window on every layer (config.sliding_window)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugins.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config: PretrainedConfig, layer_id: int) -> int | None:
        # HF Mistral: the key at distance d from the query is visible iff d < sliding_window.
        return getattr(config, "sliding_window", None) or None
