"""Llama (and SmolLM2, Llama 3.x with llama3 rope scaling): the decoder the other dense
architectures here build on. Parameter names mirror HF's, with q/k/v and gate/up stacked."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.contract.forward_batch import ForwardBatch
from core.contract.layer_ops import qk_norm_rotary
from core.layers import (
    GatedAct,
    Linear,
    LMHead,
    ModelContext,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    rope_parameters,
)
from plugins.models.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from core.contract.layer_ops import CompleteLayerOps, QKFn


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """Holds the attention weights; the computation is in DecoderLayer.forward."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int,
                 bias: tuple[bool, bool], qk_norm: bool, sliding_window: int | None,
                 scaling: float | None = None, logit_softcap: float | None = None,
                 sinks: bool = False):
        """scaling: the softmax scale (None: head_dim ** -0.5); logit_softcap: cap * tanh(s /
        cap) over the attention scores (Gemma 2); sinks: a learned logit per head in each
        softmax's denominator (GPT-OSS: `sinks`, fp32, this rank's heads)."""
        super().__init__()
        tp = ctx.tp  # this rank's heads: an even share of q heads, its KV heads (or a replica)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = D = head_dim_of(config)
        q0, self.num_heads = tp.split(heads, "attention heads")
        k0, self.num_kv_heads = tp.kv_heads(kv_heads)
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        self.qkv_proj = Linear(config.hidden_size, [heads * D, kv_heads * D, kv_heads * D],
                               bias[0], ctx, shard_names=("q", "k", "v"), parallel="column",
                               shard_rows=[(q0 * D, self.q_size), (k0 * D, self.kv_size),
                                           (k0 * D, self.kv_size)])
        self.o_proj = Linear(heads * D, config.hidden_size, bias[1], ctx, parallel="row",
                             in_part=(q0 * D, self.q_size))
        if qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, ctx.dtype, ctx.device, ctx.ops)
            self.k_norm = RMSNorm(self.head_dim, eps, ctx.dtype, ctx.device, ctx.ops)
        self._q0 = q0
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32,
                                                  device=ctx.device), requires_grad=False)
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   scaling=scaling, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap,
                                   sinks=self.sinks if sinks else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        """The attention's own parameter, the sinks [heads]: this rank's heads of them, copied
        in place (the layer's AttentionLayerParams hold this tensor)."""
        if param is getattr(self, "sinks", None) and loaded.dim() == 1 \
                and loaded.shape[0] != param.shape[0]:
            loaded = loaded.narrow(0, self._q0, self.num_heads)
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def rotate_fn(self, ops: CompleteLayerOps) -> QKFn:
        """(qkv, cos, sin, H, Hkv) -> rotated (q, k): with q/k norms (Qwen3, Gemma 3), RMSNorm
        over each q and k head first; the layer ops' kernel (one writing both, where fused)."""
        if hasattr(self, "q_norm"):
            return qk_norm_rotary(ops, self.head_dim, self.q_norm.weight, self.k_norm.weight,
                                  self.q_norm.eps)
        return ops.rotary_qk(self.head_dim)


class DecoderMLP(nn.Module):
    """Holds the gated MLP's weights; the computation is in DecoderLayer.forward."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, reduce: bool = True,
                 act: str | None = None):
        """reduce=False: the down projection's partial sums are left to the caller (a MoE
        block reduces its shared expert together with its routed experts); act: the gate's
        activation (None: the config's hidden_act, silu when it has none)."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias, ctx,
                                   shard_names=("gate", "up"), parallel="column")
        self.act = GatedAct(act or getattr(config, "hidden_act", None) or "silu", ctx.ops)
        self.down_proj = Linear(inter, config.hidden_size, bias, ctx, parallel="row",
                                reduce=reduce)

    def bound_parts(self) -> tuple:
        """(gate_up, down, act) callables for DecoderLayer's hot path: down(act(gate_up(x)))."""
        return self.gate_up_proj.bound(), self.down_proj.bound(), self.act.forward


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP, with the residual add fused into the next norm.

    The forward runs on `_hot`, a tuple of bound callables made once from the submodules (and
    again after weights change): at batch 1 on a CPU, module calls and attribute lookups would
    otherwise cost about as much as the small matmuls themselves.
    """

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int,
                 attn_bias: tuple[bool, bool], qk_norm: bool, sliding_window: int | None,
                 mlp: nn.Module | None = None, sinks: bool = False):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DecoderAttention(config, ctx, layer_id, attn_bias, qk_norm,
                                          sliding_window, sinks=sinks)
        # Any module with bound_parts() (a MoE block, for one) may replace the dense MLP.
        self.mlp = mlp if mlp is not None else DecoderMLP(config, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ctx.dtype, ctx.device, ctx.ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ctx.dtype, ctx.device,
                                                ctx.ops)
        self.ops = ctx.ops
        self._hot: tuple | None = None

    def reset_bindings(self) -> None:
        self._hot = None

    def _bind(self) -> tuple:
        a, m = self.self_attn, self.mlp
        D = a.head_dim
        rotate = a.rotate_fn(self.ops)
        self._hot = (
            self.input_layernorm.bound(), self.input_layernorm.bound_add(), a.qkv_proj.bound(),
            a.o_proj.bound(), self.post_attention_layernorm.bound_add(), *m.bound_parts(),
            rotate, a.attn.params, a.num_heads, a.num_kv_heads, D)
        return self._hot

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] (the previous layer's output), residual [T, hidden] or None at the
        first layer -> (this layer's output, the residual stream before it)."""
        (norm1, add_norm1, qkv_proj, o_proj, add_norm2, gate_up_proj, down_proj, act, rotate,
         params, H, Hkv, D) = self._hot or self._bind()
        if residual is None:
            residual, x = h, norm1(h)
        else:
            x, residual = add_norm1(h, residual)  # norm(h + residual), h + residual
        qkv = qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        v = qkv[:, (H + Hkv) * D:]
        q, k = rotate(qkv, cos, sin, H, Hkv)  # [T, H * D], [T, Hkv * D] (q/k norm first: Qwen3)
        view = batch.for_layer(params.layer_id)  # its KV group's (a hybrid pool)
        h = o_proj(view.attn_backend.forward(q, k, v, params, view))
        x, residual = add_norm2(h, residual)
        return down_proj(act(gate_up_proj(x))), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, owner: type):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype,
                                           ctx.device, quant_method=ctx.quant_method,
                                           tp=ctx.tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ctx, i, owner.attention_bias(config), owner.qk_norm,
                         owner.sliding_window(config, i), owner.make_mlp(config, ctx, i),
                         sinks=owner.attention_sinks)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device,
                            ctx.ops)
        self.rotary = RotaryEmbedding(head_dim_of(config), rope_parameters(config),
                                      config.max_position_embeddings, ctx.device)
        self.dtype = ctx.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # once for all layers
        residual = None
        for layer in self.layers:
            h, residual = layer.forward(h, residual, cos, sin, batch)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """HF LlamaForCausalLM in pure PyTorch over the paged KV cache.

    Subclasses change the per-architecture switches below (bias, q/k norm, sliding window,
    attention sinks, the MLP).
    """

    qk_norm = False
    attention_sinks = False  # a learned per-head logit in the softmax (GPT-OSS)

    @staticmethod
    def attention_bias(config: PretrainedConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def sliding_window(config: PretrainedConfig, layer_id: int) -> int | None:
        return None  # HF Llama attends to the whole context

    @staticmethod
    def make_mlp(config: PretrainedConfig, ctx: ModelContext, layer_id: int) -> nn.Module | None:
        """The layer's MLP; None: the dense gated MLP (MoE models return their expert block)."""
        return None

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = DecoderModel(config, ctx, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ctx.dtype, ctx.device,
                              tie_to=self.model.embed_tokens if self.tie_word_embeddings
                              else None,
                              final_logit_softcap=getattr(config, "final_logit_softcapping",
                                                          None),
                              quant_method=ctx.quant_method, tp=ctx.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (final soft-cap applied if any)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError naming missing/unexpected/mis-shaped ones."""
        load_named_weights(self, weights, stacked=STACKED,
                           skip_lm_head=self.tie_word_embeddings)

    def lora_targets(self) -> dict[str, tuple[Linear, str | None]]:
        """Where LoRA adapters attach: HF module name (`model.layers.0.self_attn.q_proj`) ->
        (our linear, its output shard, None for an unstacked one), for the attention and
        dense-MLP projections of every layer (a MoE block's experts take none)."""
        targets: dict[str, tuple[Linear, str | None]] = {}
        for i, layer in enumerate(self.model.layers):
            a, pre = layer.self_attn, f"model.layers.{i}"
            parts = [("self_attn", a.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                     ("self_attn", a.o_proj, ("o_proj",))]
            if isinstance(layer.mlp, DecoderMLP):
                m = layer.mlp
                parts += [("mlp", m.gate_up_proj, ("gate_proj", "up_proj")),
                          ("mlp", m.down_proj, ("down_proj",))]
            for block, linear, names in parts:
                for hf in names:
                    shard = next((sh for h, _, sh in STACKED if h == hf), None)
                    targets[f"{pre}.{block}.{hf}"] = (linear, shard)
        return targets


# HF projection -> (our stacked parameter's module, shard)
STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
           ("gate_proj", "gate_up_proj", "gate"), ("up_proj", "gate_up_proj", "up"))
