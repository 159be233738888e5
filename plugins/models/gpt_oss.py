"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama decoder arranged OpenAI's way, checked against
transformers' GptOssForCausalLM (tests/test_gpt_oss.py).

What differs from Llama:
- attention: biases on q, k, v and o; attention sinks (`self_attn.sinks`, a learned logit per
  head in each softmax's denominator, core.contract.attention.AttentionLayerParams.sinks);
  sliding-window and full layers alternating as `layer_types` says (sliding first); YaRN rope
  (its attention factor folded into cos / sin, core.layers.rotary);
- every layer's MLP is a MoE block: a router with a bias (`mlp.router`, ours `mlp.gate`), softmax
  over the k best logits (the renormalized softmax: core.contract.moe.MoELayerParams
  .renormalize), experts with biases on gate_up and down, and the clamped SwiGLU of
  transformers' GptOssExperts ("swigluoai": gate <= limit, |up| <= limit, (up + 1) * gate *
  sigmoid(alpha * gate); swiglu_alpha 1.702, swiglu_limit 7).

Checkpoint layout of the experts (bf16 / fp32, as transformers' GptOssExperts holds and saves them)
and ours (core.layers.moe.MoE): every expert in one tensor per projection,

  mlp.experts.gate_up_proj       [E, H, 2I]  columns interleaved: 2i gate i, 2i + 1 up i
  mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved alike
  mlp.experts.down_proj          [E, I, H]
  mlp.experts.down_proj_bias     [E, H]
  -> w13_weight [E, 2I, H] (gate rows, then up rows: core.contract.moe.W13_LAYOUT), w13_bias
     [E, 2I] (the same order), w2_weight [E, H, I], w2_bias [E, H].

`expert_tensor` is the one place that mapping is made.

The published gpt-oss checkpoints (quant_method "mxfp4") keep their experts in MXFP4, output-major
with the same interleaving along their rows (plugins/_kit/mxfp4.py, checked against transformers'
integrations/mxfp4.py):

  mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]  two e2m1 codes a byte, low nibble
  mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]      first; one E8M0 byte per 32 values
  mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
  mlp.experts.down_proj_scales     uint8 [E, H, I/32]
  (the biases as above)

With the mxfp4 quant method the experts stay packed: each tensor goes whole to the method's
parameter of its name (plugins._kit.mxfp4.gpt_oss_expert_tensor, gate_up rows put in
W13_LAYOUT's order). With dense experts (the plan's method is the dense one) each blocks /
scales pair is dequantized (exact in fp32), transposed to the bf16 layout above and loaded as
that (what transformers' Mxfp4Config(dequantize=True) does). Experts of any other form are
refused: an MXFP4 pair is never copied into another method's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.contract.moe import SWIGLU_ALPHA, SWIGLU_LIMIT
from core.layers import ModelContext, MoE
from plugins._kit.mxfp4 import HF_EXPERT_TENSORS, dequantize, from_hf_blocks, gpt_oss_expert_tensor
from plugins.models.gemma import SLIDING, layer_types
from plugins.models.llama import STACKED, LlamaForCausalLM
from plugins.models.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(\w+)")
_ROUTER = ".mlp.router."
_MXFP4_PART = re.compile(r"(gate_up_proj|down_proj)_(blocks|scales)")
# what dequantized MXFP4 experts may be loaded into: dense parameters (the dense method's, or an
# online method's before it quantizes them)
_DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gate_then_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """GPT-OSS's interleaved [g0, u0, g1, u1, ...] along `dim` -> [g0, g1, ... | u0, u1, ...]."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    gate = t[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat((gate, t[tuple(index)]), dim=dim)


def expert_tensor(leaf: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """One checkpoint tensor of a layer's experts, named by its leaf after `mlp.experts.`,
    -> (our MoE parameter, the tensor in our layout, whole: every expert), or None for a
    name this layout does not have (which the loader then reports as unexpected).

    The bf16 / fp32 layout (transformers' GptOssExperts): gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] transposed to [E, 2I, H] / [E, H, I], gate_up's interleaved columns
    (and its bias's) put in W13_LAYOUT's order. An MXFP4 checkpoint's `*_blocks` / `*_scales`
    are not this layout (None): load_weights maps them, packed or dequantized to this one.
    """
    if leaf in ("gate_up_proj", "gate_up_proj_bias") and (tensor.dim() < 2
                                                          or tensor.shape[-1] % 2):
        raise ValueError(f"experts.{leaf} {tuple(tensor.shape)}: its last dim holds gate and up "
                         "interleaved, so it must be even")
    if leaf == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]
        return "w13_weight", _gate_then_up(tensor, 2).transpose(1, 2).contiguous()
    if leaf == "gate_up_proj_bias":  # [E, 2I]
        return "w13_bias", _gate_then_up(tensor, 1)
    if leaf == "down_proj":  # [E, I, H] -> [E, H, I]
        return "w2_weight", tensor.transpose(1, 2).contiguous()
    if leaf == "down_proj_bias":  # [E, H]
        return "w2_bias", tensor
    return None


def swiglu_constants(config: PretrainedConfig) -> tuple[float, float]:
    """(alpha, limit) of the experts' clamped SwiGLU (configs of transformers 4.55 lack alpha,
    which was fixed at 1.702 then)."""
    alpha = getattr(config, "swiglu_alpha", None)
    limit = getattr(config, "swiglu_limit", None)
    return (SWIGLU_ALPHA if alpha is None else float(alpha),
            SWIGLU_LIMIT if limit is None else float(limit))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class GptOssMoE(MoE):
    """Router (with its bias) + experts with biases and the clamped SwiGLU: [T, H] -> [T, H]."""

    def __init__(self, config: PretrainedConfig, ctx: ModelContext, layer_id: int):
        alpha, limit = swiglu_constants(config)
        super().__init__(config.num_local_experts, config.num_experts_per_tok,
                         config.hidden_size, config.intermediate_size, ctx, renormalize=True,
                         activation="swigluoai", router_bias=True, layer_id=layer_id,
                         expert_bias=True, swiglu_alpha=alpha, swiglu_limit=limit)

    def bound_parts(self) -> tuple:
        """DecoderLayer's (gate_up, down, act) slots: the whole block, then two no-ops."""
        return self.forward, _identity, _identity


class GptOssForCausalLM(LlamaForCausalLM):
    """HF GptOssForCausalLM over the paged KV cache (see the module docstring)."""

    attention_sinks = True

    @staticmethod
    def attention_bias(config: PretrainedConfig) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    @staticmethod
    def sliding_window(config: PretrainedConfig, layer_id: int) -> int | None:
        window = getattr(config, "sliding_window", None) or None
        return window if layer_types(config)[layer_id] == SLIDING else None

    @staticmethod
    def make_mlp(config: PretrainedConfig, ctx: ModelContext, layer_id: int) -> nn.Module:
        return GptOssMoE(config, ctx, layer_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors: the router is our MoE layer's `gate`; the experts go through
        `expert_tensor` (transposed, gate/up de-interleaved) into w13 / w2 and their biases, or,
        from an MXFP4 checkpoint, whole into the mxfp4 method's packed parameters, or
        dequantized into dense experts (see the module docstring)."""
        moe = next(m for m in self.modules() if isinstance(m, GptOssMoE))
        packed = all(hasattr(moe, f"{p}_blocks") for p in ("w13", "w2"))
        dense = getattr(moe, "w13_weight", None)
        dense_dtype = dense.dtype if dense is not None and dense.dtype in _DENSE_DTYPES else None
        pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        dequantized: set[str] = set()

        def from_mxfp4(name: str, prefix: str, proj: str, part: str, tensor: torch.Tensor
                       ) -> tuple[str, torch.Tensor] | None:
            """One half of a blocks / scales pair; the dense tensor (HF's bf16 layout, through
            `expert_tensor`) once both halves are in."""
            if dense_dtype is None:
                method = type(moe.expert_quant_method).__name__
                raise ValueError(f"{name}: MXFP4 experts load kept packed (quant method mxfp4) "
                                 f"or dequantized into dense experts, not into {method}'s "
                                 "expert tensors")
            got = pending.setdefault((prefix, proj), {})
            if part in got:
                raise ValueError(f"{name} is given twice")
            got[part] = tensor
            if len(got) < 2:
                return None
            del pending[(prefix, proj)]
            packed_rows, scales = from_hf_blocks(got["blocks"], got["scales"],
                                                 f"{prefix}.experts.{proj}")
            # [E, N, K] (output-major, as stored) -> HF's [E, K, N]: gate_up [E, H, 2I],
            # down [E, I, H]
            w = dequantize(packed_rows, scales, torch.float32).transpose(1, 2)
            dequantized.add(prefix)
            return expert_tensor(proj, w)

        def ours(items: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                m = _EXPERTS.fullmatch(name)
                if m:
                    prefix, leaf = m.groups()
                    if packed and leaf in HF_EXPERT_TENSORS:
                        param, tensor = gpt_oss_expert_tensor(leaf, tensor)
                        yield f"{prefix}.{param}", tensor
                        continue
                    pair = _MXFP4_PART.fullmatch(leaf)
                    if pair:
                        mapped = from_mxfp4(name, prefix, *pair.groups(), tensor)
                        if mapped is None:
                            continue  # the other half of the pair is still to come
                    else:
                        mapped = expert_tensor(leaf, tensor)
                    if mapped is not None:
                        yield f"{prefix}.{mapped[0]}", mapped[1]
                        continue
                yield name.replace(_ROUTER, ".mlp.gate."), tensor
            if pending:
                halves = [f"{prefix}.experts.{proj}_{part}"
                          for (prefix, proj), got in pending.items() for part in got]
                raise ValueError(f"checkpoint does not match {type(self).__name__}: MXFP4 "
                                 f"blocks and scales come in pairs; alone: {', '.join(halves)}")

        load_named_weights(self, ours(weights), stacked=STACKED,
                           skip_lm_head=self.tie_word_embeddings)
        self.load_notes = ([f"mxfp4 experts of {len(dequantized)} MoE layers dequantized to "
                            f"{str(dense_dtype).removeprefix('torch.')} at load (the plan's "
                            "quant method keeps dense experts, "
                            f"{dense_dtype.itemsize * 8 / 4.25:.1f}x their MXFP4 bytes)"]
                           if dequantized else [])
