"""config.json contents of Llama-shaped models, for dummy-weight runs (`--load-format dummy`) in
benchmarks and GPU tests: the public Llama-3.1-8B shapes, and smaller models derived from them."""

from __future__ import annotations

from typing import Any

LLAMA_31_8B: dict[str, Any] = {  # public config shapes of meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu",
}


def llama_config(**overrides: Any) -> dict[str, Any]:
    """Llama-3.1-8B's config with `overrides` applied (a new dict)."""
    return {**LLAMA_31_8B, **overrides}
