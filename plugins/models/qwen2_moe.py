"""Qwen2-MoE: the Qwen2 decoder with expert blocks (a shared expert behind a sigmoid gate) on
every `decoder_sparse_step`-th layer outside `mlp_only_layers`; the MoE decoders here (Qwen3-MoE,
Mixtral) build on it. Experts run in the chosen MoE runner (core.layers.moe, core.contract.moe)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.layers import Linear, ModelContext, MoE
from plugins.models.llama import STACKED, DecoderMLP, LlamaForCausalLM
from plugins.models.qwen2 import layer_sliding_window
from plugins.models.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Per-expert checkpoint tensors (`mlp.experts.3.gate_proj.weight`, Mixtral's
# `block_sparse_moe.experts.3.w1.weight`) and fused ones (`mlp.experts.gate_up_proj`).
_EXPERT = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight\w*|input_scale)")
_FUSED = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)"
                    r"(?:\.weight)?")
_PART = {"gate_proj": ("w13", "gate"), "w1": ("w13", "gate"), "up_proj": ("w13", "up"),
         "w3": ("w13", "up"), "down_proj": ("w2", "down"), "w2": ("w2", "down")}
_FUSED_PARAM = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


def moe_param_name(hf_name: str) -> tuple[str, str | None] | None:
    """Our (parameter, shard) for an HF expert tensor or Mixtral's router; None for the rest."""
    m = _EXPERT.fullmatch(hf_name)
    if m:  # weight, or a quant method's weight_scale_inv / weight_scale / ...
        prefix, expert, proj, suffix = m.groups()
        param, part = _PART[proj]
        return f"{prefix}.mlp.{param}_{suffix}", f"{expert}.{part}"
    m = _FUSED.fullmatch(hf_name)
    if m:
        prefix, proj = m.groups()
        return f"{prefix}.mlp.{_FUSED_PARAM[proj]}", None
    if ".block_sparse_moe." in hf_name:  # Mixtral's router: block_sparse_moe.gate
        return hf_name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def shared_expert(config: PretrainedConfig, ctx: ModelContext, intermediate_size: int
                  ) -> DecoderMLP:
    """The shared expert: the dense gated MLP at its own width (HF names gate_proj / up_proj /
    down_proj, stacked like a dense layer's). Under tensor parallelism its down projection
    is not reduced on its own: the block reduces it with the routed experts' sum."""
    narrow = copy.copy(config)
    narrow.intermediate_size = intermediate_size
    narrow.mlp_bias = False
    return DecoderMLP(narrow, ctx, reduce=False)


class SparseMoeBlock(MoE):
    """Router + experts (+ a shared expert, gated per token by sigmoid(shared_expert_gate(x))
    where the model has one): hidden [T, H] -> [T, H]."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int, *,
                 num_experts: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int | None = None):
        super().__init__(num_experts, config.num_experts_per_tok, config.hidden_size,
                         intermediate_size, ctx, renormalize=renormalize,
                         activation=getattr(config, "hidden_act", "silu"), layer_id=layer_id)
        if shared_intermediate_size:
            self.shared_expert = shared_expert(config, ctx, shared_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, False, ctx)

    def forward(self, hidden: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        if shared is None and hasattr(self, "shared_expert"):
            gate_up, down, act = self.shared_expert.bound_parts()
            shared = down(act(gate_up(hidden))) * torch.sigmoid(self.shared_expert_gate(hidden))
        return super().forward(hidden, shared)

    def bound_parts(self) -> tuple:
        """DecoderLayer's (gate_up, down, act) slots: the whole block, then two no-ops."""
        return self.forward, _identity, _identity


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_bias(config: PretrainedConfig) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    sliding_window = staticmethod(layer_sliding_window)

    @staticmethod
    def moe_layers(config: PretrainedConfig) -> tuple[int, ...]:
        """Every `decoder_sparse_step`-th layer, counted from 1, outside `mlp_only_layers` (as
        core.plan.model_spec.moe_layer_ids reads it for the plan)."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        return tuple(i for i in range(config.num_hidden_layers)
                     if (i + 1) % step == 0 and i not in dense)

    @staticmethod
    def num_experts(config: PretrainedConfig) -> int:
        return config.num_experts

    @staticmethod
    def renormalize(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    @staticmethod
    def shared_intermediate_size(config: PretrainedConfig) -> int | None:
        return getattr(config, "shared_expert_intermediate_size", None) or None

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, ctx: ModelContext, layer_id: int
                 ) -> nn.Module | None:
        if cls.num_experts(config) <= 0 or layer_id not in cls.moe_layers(config):
            return None  # a dense layer: the gated MLP of config.intermediate_size
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return SparseMoeBlock(config, ctx, layer_id, num_experts=cls.num_experts(config),
                              intermediate_size=inter, renormalize=cls.renormalize(config),
                              shared_intermediate_size=cls.shared_intermediate_size(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors; per-expert tensors are stacked into w13 / w2 as they come."""
        load_named_weights(self, weights, stacked=STACKED, skip_lm_head=self.tie_word_embeddings,
                           rename=moe_param_name)
