"""Model spec: what the resolver needs to know about a model, read from its HF config alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    intermediate_size: int | None = None
    grouped_topk: bool = False  # DeepSeek-style group-limited routing
    num_groups: int | None = None
    topk_groups: int | None = None
    activation: str = "silu"


@dataclass(frozen=True)
class ModelSpec:
    """Facts about a model from its config.json (no weights read).

    attention_kind: MHA (kv heads == heads), GQA (1 < kv heads < heads), MQA (1 kv head), MLA.
    sliding_windows: per layer, None where the layer attends to the whole context.
    dtype: the config's torch_dtype as a name (float32 / float16 / bfloat16), or None.
    unread: what could not be read from the config, said in words (never silently guessed).
    """

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    attention_kind: str
    vocab_size: int
    context_length: int
    dtype: str | None = None
    sliding_windows: tuple[int | None, ...] = ()
    logit_softcap: float | None = None  # attention logit soft-cap
    final_logit_softcap: float | None = None
    attention_sinks: bool = False
    # MLA latent dims (DeepSeek-V2/V3): kv_lora_rank, q_lora_rank, qk_nope/rope head dims
    mla: dict[str, int] | None = None
    moe: MoESpec | None = None
    quantization: dict[str, Any] | None = None  # the HF quantization_config as given
    quant_method: str = "none"  # quantization_config["quant_method"], or "none"
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None
    unread: tuple[str, ...] = ()
    source: str = ""

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None
