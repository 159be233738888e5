"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention and gated MLP, arranged Gemma's way.

What differs from Llama (HF's Gemma2 / Gemma3 modeling, checked against it in tests/test_models.py):
- every RMSNorm scales by (1 + weight): the checkpoint's weights get the 1 added once at load, so
  the shared RMSNorm (and its fused kernels) run unchanged (a llama.cpp GGUF file stores 1 + w:
  core.engine.gguf_weights takes the 1 off, and the config fields its header lacks come from
  core.plan.gguf_metadata.gemma_config);
- "sandwich" norms: the attention output and the MLP output are normed before their residual add
  (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input has its own norm
  (pre_feedforward_layernorm);
- the embeddings are scaled by sqrt(hidden_size) (in the activations' dtype, as HF rounds it);
- the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- sliding-window and global layers interleave (`layer_types`); Gemma 2 soft-caps the attention
  scores (attn_logit_softcapping) and the final logits (final_logit_softcapping);
- the MLP's activation is GELU with the tanh approximation (GeGLU);
- Gemma 3: RMSNorm over each q and k head before rotary (also 1 + weight), and its own rope
  parameters for sliding and for global layers (`rope_parameters` keyed by layer type, or the
  older rope_local_base_freq beside rope_theta / rope_scaling).

The KV pool keeps every layer's whole context: a windowed layer masks what fell out of its window
but does not yet free it (the hybrid pool of issue 35 is not built).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.contract.forward_batch import ForwardBatch
from core.contract.json_types import JSONObject
from core.layers import (
    LMHead,
    ModelContext,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    rope_parameters,
)
from plugins.models.llama import STACKED, DecoderAttention, DecoderMLP, head_dim_of
from plugins.models.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention type: `layer_types` where the config has it, else Gemma 2's
    alternation (sliding first) or Gemma 3's `sliding_window_pattern` (every n-th is global)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None)
    if pattern:
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    return [SLIDING if i % 2 == 0 else FULL for i in range(n)]


def layer_rope(config: PretrainedConfig, kind: str) -> JSONObject:
    """The rope parameters of a layer of type `kind` (Gemma 3 has one set per type)."""
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):
        if kind not in params:
            raise ValueError(f"rope_parameters has no entry for {kind!r} layers")
        got = dict(params[kind])
        got["rope_type"] = got.get("rope_type") or got.get("type") or "default"
        return got
    local = getattr(config, "rope_local_base_freq", None)
    if kind == SLIDING and local is not None:  # older Gemma 3 configs: local layers unscaled
        return {"rope_type": "default", "rope_theta": float(local)}
    return rope_parameters(config)


def gemma_activation(config: PretrainedConfig) -> str:
    """The MLP's activation: `hidden_activation` (HF Gemma's field; `hidden_act` in older
    configs), GELU with the tanh approximation when neither is set."""
    return (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            or "gelu_pytorch_tanh")


class GemmaDecoderLayer(nn.Module):
    """Input norm -> attention -> post-attention norm -> residual add -> pre-MLP norm -> MLP ->
    post-MLP norm; the residual add is fused into the next norm as in Llama's layer, and the
    post-attention norm, its add and the pre-MLP norm run as one op (RMSNorm.bound_add_norm)."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int, kind: str,
                 qk_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        window = config.sliding_window if kind == SLIDING else None
        scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)
        self.self_attn = DecoderAttention(
            config, ctx, layer_id, (False, False), qk_norm, window, scaling=scalar ** -0.5,
            logit_softcap=getattr(config, "attn_logit_softcapping", None) or None)
        self.mlp = DecoderMLP(config, ctx, act=gemma_activation(config))
        h, dt, dev, ops = config.hidden_size, ctx.dtype, ctx.device, ctx.ops
        self.input_layernorm = RMSNorm(h, eps, dt, dev, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, dt, dev, ops)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dt, dev, ops)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dt, dev, ops)
        self.kind = kind
        self.ops = ctx.ops
        self._hot: tuple | None = None

    def reset_bindings(self) -> None:
        self._hot = None

    def _bind(self) -> tuple:
        a = self.self_attn
        rotate = a.rotate_fn(self.ops)
        self._hot = (
            self.input_layernorm.bound(), self.input_layernorm.bound_add(), a.qkv_proj.bound(),
            a.o_proj.bound(),
            self.post_attention_layernorm.bound_add_norm(self.pre_feedforward_layernorm),
            *self.mlp.bound_parts(),
            self.post_feedforward_layernorm.bound(), rotate, a.attn.params, a.num_heads,
            a.num_kv_heads, a.head_dim)
        return self._hot

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        (norm_in, add_norm_in, qkv_proj, o_proj, norm_add_norm_mlp, gate_up, down, act,
         norm_post_mlp, rotate, params, H, Hkv, D) = self._hot or self._bind()
        if residual is None:
            residual, x = h, norm_in(h)
        else:
            x, residual = add_norm_in(h, residual)
        qkv = qkv_proj(x)
        v = qkv[:, (H + Hkv) * D:]
        q, k = rotate(qkv, cos, sin, H, Hkv)
        view = batch.for_layer(params.layer_id)  # its KV group's (a hybrid pool)
        # post-attention norm, residual add, pre-MLP norm
        x, residual = norm_add_norm_mlp(o_proj(view.attn_backend.forward(q, k, v, params, view)),
                                        residual)
        return norm_post_mlp(down(act(gate_up(x)))), residual


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype,
                                           ctx.device, quant_method=ctx.quant_method,
                                           tp=ctx.tp)
        kinds = layer_types(config)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ctx, i, kind, qk_norm)
                                    for i, kind in enumerate(kinds))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device,
                            ctx.ops)
        D, n = head_dim_of(config), config.max_position_embeddings
        # one table per distinct rope (Gemma 2: one; Gemma 3: local and global)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(D, layer_rope(config, kind), n,
                                                           ctx.device)
                                     for kind in sorted(set(kinds))})
        self.normalizer = config.hidden_size ** 0.5
        self.dtype = ctx.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # HF multiplies by the normalizer rounded to the activations' dtype
        h = h * torch.tensor(self.normalizer, dtype=h.dtype)
        tables = {kind: rope.cos_sin(positions, self.dtype) for kind, rope in self.rotary.items()}
        residual = None
        for layer in self.layers:
            cos, sin = tables[layer.kind]
            h, residual = layer.forward(h, residual, cos, sin, batch)
        h, _ = self.norm(h, residual)
        return h


class Gemma2ForCausalLM(nn.Module):
    """HF Gemma2ForCausalLM over the paged KV cache (see the module docstring)."""

    qk_norm = False

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = GemmaModel(config, ctx, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ctx.dtype, ctx.device,
                              tie_to=self.model.embed_tokens if self.tie_word_embeddings
                              else None,
                              final_logit_softcap=getattr(config, "final_logit_softcapping",
                                                          None) or None,
                              quant_method=ctx.quant_method, tp=ctx.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def norms(self) -> list[RMSNorm]:
        """Every RMSNorm of the model (Gemma's scale by 1 + weight)."""
        return [m for m in self.modules() if isinstance(m, RMSNorm)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors; each norm's weight w becomes 1 + w (Gemma's RMSNorm)."""
        load_named_weights(self, weights, stacked=STACKED,
                           skip_lm_head=self.tie_word_embeddings)
        with torch.no_grad():
            for norm in self.norms():
                norm.weight.add_(1.0)
        for layer in self.model.layers:
            layer.reset_bindings()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """HF Gemma3ForCausalLM (text only): Gemma 2's layout plus q/k norms and two ropes."""

    qk_norm = True
