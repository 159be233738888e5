"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 (Kimi-K2 and Moonlight are the same architecture):
multi-head latent attention (core.contract.mla) and DeepSeek's MoE (shared experts, the first
`first_k_dense_replace` layers dense).

Attention per layer (H heads, Dn / Dr / Dv the nope / rope / value head dims, R = kv_lora_rank):
q = q_proj(x), or q_b_proj(norm(q_a_proj(x))) where q_lora_rank is set, split per head into
q_nope [Dn] and q_rope [Dr]; kv_a_proj_with_mqa(x) -> latent [R] (then kv_a_layernorm) and
k_rope [Dr], one for all heads. Rotary runs on the rope dims only: the checkpoints lay them out
in interleaved pairs (x0, x1), (x2, x3), ... (HF rotates each pair by one frequency), so they are
de-interleaved, [x0, x2, ... | x1, x3, ...], and rotated in the half layout: the same rotation
of q and k, hence the same q.k (V3 with rope_interleave false is not permuted). Both are the
layer ops' `rotary_mla` (one kernel for q and k where the plugin fuses it). YaRN's
mscale (mscale_all_dim) is folded into the softmax scale; its attention factor into cos / sin.
The MLA backend gets the rest (kv_b_proj's halves, the latent cache).

Routing: V2 softmax scores, `greedy` or `group_limited_greedy` (groups by their best expert);
V3 `noaux_tc`: sigmoid scores, e_score_correction_bias for the choice, groups by their top-2
sum, `topk_group`, `norm_topk_prob`. Weights times `routed_scaling_factor` (core.contract.moe).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLALayerParams
from core.layers import Linear, LMHead, ModelContext, RMSNorm, RotaryEmbedding, VocabEmbedding
from core.layers.mla import MLAAttention
from core.layers.rotary import rope_parameters, yarn_softmax_mscale
from plugins.models.llama import DecoderMLP
from plugins.models.qwen2_moe import SparseMoeBlock, moe_param_name, shared_expert
from plugins.models.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# gate / up of the dense and shared MLPs stacked (no q/k/v stacking: MLA has none)
STACKED = (("gate_proj", "gate_up_proj", "gate"), ("up_proj", "gate_up_proj", "up"))
# HF keeps the V3 router's bias on the gate; ours is the MoE layer's own parameter
_BIAS = ".mlp.gate.e_score_correction_bias"


class DeepseekAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int,
                 interleaved: bool):
        super().__init__()
        # Tensor parallelism: this rank's H / tp heads. q (q_proj / q_b_proj) is
        # column-parallel and kv_b_proj's rows split (both per head, contiguous), o_proj
        # row-parallel (one all-reduce); q_a_proj, kv_a_proj_with_mqa and their norms are
        # replicated, so every rank computes the whole latent row and caches it (the latent
        # cache is replicated, as SGLang does without DP attention).
        H = ctx.tp.split(config.num_attention_heads, "attention heads")[1]
        col = "column" if ctx.tp.active else None
        self.num_heads = H
        self.dn, self.dr = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.dv, self.r = config.v_head_dim, config.kv_lora_rank
        self.rotary = ctx.ops.rotary_mla(self.dr, interleaved)
        bias = bool(getattr(config, "attention_bias", False))
        hidden, qk = config.hidden_size, self.dn + self.dr
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        heads_all = config.num_attention_heads  # Linear takes the model's sizes
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads_all * qk, False, ctx, parallel=col)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, ctx)
            # HF's q_a / kv_a norms take their default eps, not rms_norm_eps
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, ctx.dtype, ctx.device, ctx.ops)
            self.q_b_proj = Linear(self.q_lora_rank, heads_all * qk, False, ctx, parallel=col)
        self.kv_a_proj_with_mqa = Linear(hidden, self.r + self.dr, bias, ctx)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6, ctx.dtype, ctx.device, ctx.ops)
        self.o_proj = Linear(heads_all * self.dv, hidden, bias, ctx,
                             parallel="row" if ctx.tp.active else None)
        params = rope_parameters(config)
        scaling = qk ** -0.5 * yarn_softmax_mscale(params, config.max_position_embeddings)
        self.attn = MLAAttention(MLALayerParams(
            layer_id=layer_id, num_heads=H, kv_lora_rank=self.r, qk_nope_head_dim=self.dn,
            qk_rope_head_dim=self.dr, v_head_dim=self.dv, scaling=scaling), ctx.dtype,
            ctx.device, ctx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.dn + self.dr)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:]
        kv = self.kv_a_proj_with_mqa(x)  # [T, R + Dr]
        latent = self.kv_a_layernorm(kv[:, :self.r])  # a row-strided view (layer ops take it)
        q_rope, k_rope = self.rotary(q_rope, kv[:, self.r:], cos, sin)  # [T, H, Dr], [T, Dr]
        out = self.attn(q_nope, q_rope, latent, k_rope, batch)  # [T, H * Dv]
        return self.o_proj(out)


class DeepseekMoE(SparseMoeBlock):
    """Routed experts + `n_shared_experts` shared ones (one MLP n times as wide, ungated)."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int, v3: bool):
        groups, topk_groups = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        grouped = (groups, topk_groups) if method != "greedy" and (groups or 1) > 1 else None
        inter = config.moe_intermediate_size
        super(SparseMoeBlock, self).__init__(
            config.n_routed_experts, config.num_experts_per_tok, config.hidden_size, inter, ctx,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            activation=getattr(config, "hidden_act", "silu"), grouped_topk=grouped,
            scoring_func="sigmoid" if method == "noaux_tc" else "softmax",
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            layer_id=layer_id, correction_bias=method == "noaux_tc")
        n_shared = getattr(config, "n_shared_experts", None) or 0
        if n_shared:
            self.shared_experts = shared_expert(config, ctx, inter * n_shared)

    def forward(self, hidden: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        if shared is None and hasattr(self, "shared_experts"):
            gate_up, down, act = self.shared_experts.bound_parts()
            shared = down(act(gate_up(hidden)))
        return super(SparseMoeBlock, self).forward(hidden, shared)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int, v3: bool,
                 interleaved: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DeepseekAttention(config, ctx, layer_id, interleaved)
        dense = layer_id < (getattr(config, "first_k_dense_replace", 0) or 0) \
            or not getattr(config, "n_routed_experts", None)
        self.mlp = DecoderMLP(config, ctx) if dense else DeepseekMoE(config, ctx, layer_id, v3)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ctx.dtype, ctx.device, ctx.ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ctx.dtype, ctx.device,
                                                ctx.ops)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, batch)
        x, residual = self.post_attention_layernorm(h, residual)
        gate_up, down, act = self.mlp.bound_parts()
        return down(act(gate_up(x))), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: PretrainedConfig, ctx: ModelContext, v3: bool, interleaved: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx.dtype,
                                           ctx.device, quant_method=ctx.quant_method, tp=ctx.tp)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, ctx, i, v3, interleaved)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device,
                            ctx.ops)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config),
                                      config.max_position_embeddings, ctx.device)
        self.dtype = ctx.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, 1, Dr], once for all layers
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, batch)
        h, _ = self.norm(h, residual)
        return h


class DeepseekV2ForCausalLM(nn.Module):
    """HF DeepseekV2ForCausalLM (V2, V2-Lite) over the MLA latent cache."""

    v3 = False

    def __init__(self, config: PretrainedConfig, ctx: ModelContext):
        super().__init__()
        self.config = config
        # V2 always rotates interleaved pairs; V3 says so in rope_interleave (default true)
        interleaved = bool(getattr(config, "rope_interleave", True)) if self.v3 else True
        self.model = DeepseekModel(config, ctx, self.v3, interleaved)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ctx.dtype, ctx.device,
                              tie_to=self.model.embed_tokens if self.tie_word_embeddings
                              else None, quant_method=ctx.quant_method, tp=ctx.tp)
        self.load_notes: list[str] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors. Layers past num_hidden_layers (V3's multi-token-prediction layer)
        are skipped, and said so in `load_notes`."""
        n_layers = self.config.num_hidden_layers
        skipped: set[int] = set()

        def ours(items: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                m = _LAYER.match(name)
                if m and int(m.group(1)) >= n_layers:
                    skipped.add(int(m.group(1)))
                    continue
                if name.endswith(_BIAS):
                    name = name.replace(_BIAS, ".mlp.e_score_correction_bias")
                # the checkpoint's self_attn.kv_b_proj is held by the MLA layer
                name = name.replace(".self_attn.kv_b_proj.", ".self_attn.attn.kv_b_proj.")
                yield name, tensor

        load_named_weights(self, ours(weights), stacked=STACKED,
                           skip_lm_head=self.tie_word_embeddings, rename=moe_param_name)
        if any(layer.self_attn.attn.dequantized for layer in self.model.layers):
            self.load_notes.append(
                "kv_b_proj dequantized at load (its codes times their block scales in fp32, "
                "then cast to the compute dtype): the MLA backend splits and absorbs it dense")
        if skipped:
            self.load_notes.append(
                f"skipped checkpoint layers {', '.join(map(str, sorted(skipped)))} (past "
                f"num_hidden_layers {n_layers}: the multi-token-prediction module, which "
                f"speculative decoding would use; not served)")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """HF DeepseekV3ForCausalLM: V2's model with noaux_tc routing (sigmoid scores,
    e_score_correction_bias, groups by their top-2 sum)."""

    v3 = True
