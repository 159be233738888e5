"""Checkers: does one registered backend fit this model on this device under these settings?

One pure function per plugin kind. Each returns the list of reasons the candidate does not fit
(empty when it fits), in words a user can act on. The checks read only capability fields, so a
backend's rules (FlashMLA's page size, FA3's e4m3-only FP8 KV, AMX on CPU) live in its declaration,
never here. A requirement passed as `None` is one the caller left open: it is not checked.

`requires` packages are looked up with importlib.util.find_spec, never imported: declaring and
checking a backend must not load its kernel library.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterable, Mapping
from typing import Protocol

from core.contract.capabilities import (
    AttentionCaps,
    CapabilityRange,
    DeviceInfo,
    GrammarCaps,
    LayerOpsCaps,
    LoRACaps,
    ModelCaps,
    MoECaps,
    QuantCaps,
    SpecCaps,
    c_compiler,
)
from core.plan.model_spec import ModelSpec
from core.plan.quant_scheme import QuantScheme

# In `devices`: every target, for plain-PyTorch code that runs on whatever torch device the
# target's Platform gives (a vendor's own target included).
ANY_DEVICE = "*"


class DeviceNeeds(Protocol):
    """The caps fields check_device reads: those of every backend kind but hardware, models and
    tool parsers (attention, MoE, quant, layer ops, grammar)."""

    @property
    def devices(self) -> frozenset[str]: ...

    @property
    def capability(self) -> Mapping[str, CapabilityRange]: ...

    @property
    def cpu_isa(self) -> frozenset[str]: ...

    @property
    def requires(self) -> tuple[str, ...]: ...


# How a device target's capability numbers are spelled in a reason.
_CAPABILITY_WORD = {"cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "npu": "NPU"}


def _join(values: Iterable[object]) -> str:
    items = sorted(str(v) for v in values)
    return ", ".join(items) if items else "none"


def missing_packages(requires: Iterable[str]) -> list[str]:
    """The required packages that cannot be found (without importing them).

    Only the top-level package is looked up: find_spec on "a.b" would import "a".
    """
    missing = []
    for name in requires:
        top = name.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_programs(programs: Iterable[str]) -> list[str]:
    """The required executables that are not on PATH; "cc" means any C compiler
    (c_compiler)."""
    return [name for name in programs
            if (c_compiler() if name == "cc" else shutil.which(name)) is None]


def _capability_reason(target: str, rng: CapabilityRange, device: DeviceInfo) -> str | None:
    if rng.accepts(device.capability, device.arch):
        return None
    word = _CAPABILITY_WORD.get(target, target)
    have = device.arch or (f"sm{device.capability}" if device.capability is not None
                           else "of unknown capability")
    if rng.archs is not None and (device.arch is None or device.arch not in rng.archs):
        return f"needs {word} {'|'.join(sorted(rng.archs))} (device is {have})"
    if rng.min is not None and rng.max is not None:
        need = f"sm{rng.min}-sm{rng.max}" if rng.min != rng.max else f"sm{rng.min}"
    elif rng.min is not None:
        need = f"sm{rng.min}+"
    else:
        need = f"sm{rng.max} or older"
    return f"needs {word} {need} (device is {have})"


def check_device(caps: DeviceNeeds, device: DeviceInfo) -> list[str]:
    """Reasons shared by every backend kind: target, capability range, CPU ISA, packages."""
    reasons: list[str] = []
    if ANY_DEVICE not in caps.devices and device.target not in caps.devices:
        reasons.append(f"device {device.target} not supported (supports {_join(caps.devices)})")
    else:
        rng = caps.capability.get(device.target)
        if rng is not None:
            reason = _capability_reason(device.target, rng, device)
            if reason:
                reasons.append(reason)
        # ISA needs describe the host CPU: only a CPU device reports those features.
        if device.device_type == "cpu":
            lacking = sorted(f for f in caps.cpu_isa if not device.has(f))
            for feature in lacking:
                reasons.append(f"needs CPU feature {feature} "
                               f"(device has {','.join(sorted(device.features)) or 'none'})")
    for name in missing_packages(caps.requires):
        reasons.append(f"package {name} is not installed")
    for program in missing_programs(getattr(caps, "programs", ())):
        reasons.append(f"program {program} is not on PATH")
    return reasons


def _dtype_reason(dtype: str | None, supported: frozenset[str]) -> list[str]:
    if dtype is None or dtype in supported:
        return []
    return [f"compute dtype {dtype} not supported (supports {_join(supported)})"]


def attention_head_sizes(spec: ModelSpec) -> tuple[int, ...]:
    """The head sizes an attention kernel sees for this model.

    MLA kernels attend over the compressed latent (kv_lora_rank + rope dims, e.g. 512 + 64 = 576)
    when the config gives those; otherwise the per-head dims (q/k and, if different, v).
    """
    mla = spec.mla or {}
    if spec.attention_kind == "MLA" and "kv_lora_rank" in mla and "qk_rope_head_dim" in mla:
        return (int(mla["kv_lora_rank"]) + int(mla["qk_rope_head_dim"]),)
    sizes = [spec.head_dim]
    if spec.v_head_dim and spec.v_head_dim != spec.head_dim:
        sizes.append(spec.v_head_dim)
    return tuple(sizes)


def check_attention(caps: AttentionCaps, spec: ModelSpec, device: DeviceInfo, *, phase: str,
                    dtype: str | None, kv_cache_dtype: str | None, page_size: int | None,
                    cuda_graph: bool | None) -> list[str]:
    """Reasons an attention backend cannot serve `phase` of this model on this device."""
    reasons = check_device(caps, device)
    if phase not in caps.phases:
        reasons.append(f"{phase} phase not supported (supports {_join(caps.phases)})")
    if spec.attention_kind not in caps.attention_kinds:
        if spec.attention_kind == "MLA":
            reasons.append("MLA models need an MLA backend")
        else:
            reasons.append(f"attention kind {spec.attention_kind} not supported "
                           f"(supports {_join(caps.attention_kinds)})")
    if caps.head_sizes is not None:
        for size in attention_head_sizes(spec):
            if size not in caps.head_sizes:
                heads = "|".join(str(h) for h in sorted(caps.head_sizes))
                reasons.append(f"head dim {size} not supported (supports {heads})")
    reasons += _dtype_reason(dtype, caps.dtypes)
    if kv_cache_dtype is not None and kv_cache_dtype not in caps.kv_cache_dtypes:
        reasons.append(f"{kv_cache_dtype} KV cache not supported "
                       f"(supports {_join(caps.kv_cache_dtypes)})")
    elif kv_cache_dtype is not None:
        lacking = sorted(f for f in caps.kv_cache_dtype_features.get(kv_cache_dtype, ())
                         if not device.has(f))
        for feature in lacking:
            reasons.append(f"{kv_cache_dtype} KV cache needs device feature {feature} (device "
                           f"{device.arch or device.target} has "
                           f"{','.join(sorted(device.features)) or 'none'})")
    if page_size is not None and not caps.page_sizes.accepts(page_size):
        reasons.append(f"page size {page_size} not accepted "
                       f"(needs {caps.page_sizes.describe()})")
    if spec.has_sliding_window and not caps.sliding_window:
        n = sum(w is not None for w in spec.sliding_windows)
        reasons.append(f"no sliding-window support (model {spec.architecture} uses a window "
                       f"on {n} of {len(spec.sliding_windows)} layers)")
    if spec.logit_softcap and not caps.logit_softcap:
        reasons.append(f"no logit soft-cap support (model {spec.architecture} caps logits at "
                       f"{spec.logit_softcap:g})")
    if spec.attention_sinks and not caps.sinks:
        reasons.append(f"no attention-sink support (model {spec.architecture} uses sinks)")
    if cuda_graph and not caps.cuda_graph:
        reasons.append("cannot be captured in CUDA graphs")
    return reasons


def check_moe(caps: MoECaps, spec: ModelSpec, device: DeviceInfo, *, dtype: str | None,
              quant_method: str | None, quant_caps: QuantCaps | None = None,
              runner: str | None = None, ep_size: int = 1,
              quant_format: str | None = None) -> list[str]:
    """Reasons a MoE runner cannot run this model's experts (dense models: no reasons)."""
    reasons = check_device(caps, device)
    reasons += _dtype_reason(dtype, caps.dtypes)
    if quant_method is not None and quant_caps is None \
            and quant_method not in caps.quant_methods:
        reasons.append(f"quant method {quant_method} not supported "
                       f"(supports {_join(caps.quant_methods)})")
    elif quant_method is not None and quant_caps is not None:
        reasons += check_moe_quant(runner or "", caps, quant_method, quant_caps)
    reasons += check_moe_format(runner or "", caps, quant_format, quant_caps)
    moe = spec.moe
    if moe is None:
        return reasons
    if moe.activation not in caps.activations:
        reasons.append(f"activation {moe.activation} not supported "
                       f"(supports {_join(caps.activations)})")
    if moe.scoring_func not in caps.scoring_funcs:
        reasons.append(f"{moe.scoring_func} router scoring not supported "
                       f"(supports {_join(caps.scoring_funcs)})")
    if moe.grouped_topk and not caps.grouped_topk:
        reasons.append(f"no grouped top-k routing (model {spec.architecture} routes within "
                       f"expert groups)")
    if moe.correction_bias and not caps.correction_bias:
        reasons.append(f"no routing with a correction bias (model {spec.architecture} routes "
                       f"with noaux_tc: e_score_correction_bias, groups by their top-2 sum)")
    if moe.expert_bias and not caps.expert_bias:
        reasons.append(f"no expert biases (model {spec.architecture} adds a bias to each "
                       f"expert's gate/up and down projections)")
    if moe.num_shared_experts and not caps.shared_experts:
        reasons.append(f"no shared-expert support (model has {moe.num_shared_experts})")
    if caps.max_experts is not None and moe.num_experts > caps.max_experts:
        reasons.append(f"{moe.num_experts} experts exceed the limit of {caps.max_experts}")
    if caps.max_top_k is not None and moe.top_k > caps.max_top_k:
        reasons.append(f"top-k {moe.top_k} exceeds the limit of {caps.max_top_k}")
    if ep_size > 1 and not caps.expert_parallel:
        reasons.append(f"does not run a rank's share of the experts (--ep-size {ep_size})")
    return reasons


def check_quant(caps: QuantCaps, spec: ModelSpec, device: DeviceInfo, *, dtype: str | None,
                requested: str | None, scheme: QuantScheme | None = None,
                tp_size: int = 1) -> list[str]:
    """Reasons a quant method cannot load this checkpoint here.

    `requested` is the quantization_config name to load ("none" for a dense checkpoint); None
    means the checkpoint's own `spec.quant_method`. `scheme` (core.contract.quant) is what the weights
    are, or become when quantized at load (scheme.online).
    """
    reasons = check_device(caps, device)
    want = requested if requested is not None else spec.quant_method
    loads = True
    if scheme is not None and scheme.online:
        if caps.online_format != scheme.format:
            loads = False
            reasons.append(f"does not quantize a dense checkpoint into {scheme.format} at load")
    elif want not in caps.config_names:
        loads = False
        reasons.append(f"does not load {want} checkpoints (loads {_join(caps.config_names)})")
    if scheme is not None and loads:  # what it computes matters once it reads the file
        reasons += _scheme_reasons(caps, scheme) + _block_grain_reasons(spec, scheme)
    lacking = sorted(f for f in caps.needs_features if not device.has(f))
    for feature in lacking:
        reasons.append(f"needs device feature {feature} "
                       f"(device has {','.join(sorted(device.features)) or 'none'})")
    reasons += _dtype_reason(dtype, caps.dtypes)
    if spec.is_moe and not caps.moe:
        reasons.append("cannot quantize MoE expert weights")
    if tp_size > 1 and not caps.tensor_parallel:
        reasons.append(f"its weights do not split over tensor-parallel ranks (--tp-size "
                       f"{tp_size})")
    if spec.attention_kind == "MLA" and scheme is not None and scheme.format != "dense" \
            and not caps.dense_weights:
        reasons.append("cannot give MLA's kv_b_proj back dense (QuantCaps.dense_weights), "
                       "which latent absorption needs")
    return reasons


def _scheme_reasons(caps: QuantCaps, scheme: QuantScheme) -> list[str]:
    if caps.formats and scheme.format not in caps.formats:
        return [f"does not compute {scheme.format} weights (computes {_join(caps.formats)})"]
    reasons = []
    if caps.activation_schemes and scheme.activations not in caps.activation_schemes:
        reasons.append(f"{scheme.activations} activation scales not supported "
                       f"(supports {_join(caps.activation_schemes)})")
    if caps.weight_bits and scheme.weight_bits and scheme.weight_bits not in caps.weight_bits:
        reasons.append(f"{scheme.weight_bits}-bit weights not supported")
    if caps.group_sizes and scheme.group_size and scheme.group_size not in caps.group_sizes:
        reasons.append(f"group size {scheme.group_size} not supported "
                       f"(supports {_join(caps.group_sizes)})")
    return reasons


def _block_grain_reasons(spec: ModelSpec, scheme: QuantScheme) -> list[str]:
    """Block-scaled weights whose separate gate and up projections are stacked into one
    tensor (a dense MLP's or a shared expert's gate_up): up's rows must start on a block, or
    one block of scales would straddle both. A partial last block elsewhere (DeepSeek-V3's
    kv_a_proj_with_mqa: 576 rows) is fine. Routed experts are not checked here: a checkpoint
    may hold them fused (one scale grid for gate and up), and per-expert ones are refused by
    the MoE layer's loader with the same reason."""
    if not scheme.block:
        return []
    rows = scheme.block[0]
    widths = {"intermediate_size": spec.intermediate_size or 0}
    if spec.moe is not None:
        widths["shared expert width"] = spec.moe.shared_expert_intermediate_size or 0
        if spec.moe.moe_layers and len(spec.moe.moe_layers) == spec.num_layers:
            widths.pop("intermediate_size")  # no dense layer: its width is never built
    return [f"{name} {n} is not a multiple of the {rows}-row weight blocks (gate and up "
            f"share one stacked tensor and its block scales)"
            for name, n in widths.items() if n % rows]


def check_moe_quant(runner: str, moe_caps: MoECaps, quant: str, quant_caps: QuantCaps
                    ) -> list[str]:
    """The MoE runner and the quant method must agree on the experts' weight form: either
    side's caps naming the other is enough."""
    if quant in moe_caps.quant_methods or runner in quant_caps.moe_runners:
        return []
    also = (f"; {quant} runs its experts on {_join(quant_caps.moe_runners)}"
            if quant_caps.moe_runners else "")
    return [f"quant method {quant} not supported (supports {_join(moe_caps.quant_methods)})"
            f"{also}"]


def check_moe_format(runner: str, moe_caps: MoECaps, quant_format: str | None,
                     quant_caps: QuantCaps | None = None) -> list[str]:
    """A runner that runs only some formats of a method (MoECaps.quant_formats) must list the
    checkpoint's, unless the quant method names the runner itself."""
    if quant_format in (None, "dense") or not moe_caps.quant_formats \
            or quant_format in moe_caps.quant_formats \
            or (quant_caps is not None and runner in quant_caps.moe_runners):
        return []
    return [f"{quant_format} experts not supported (runs {_join(moe_caps.quant_formats)})"]


def check_layer_ops(caps: LayerOpsCaps, device: DeviceInfo, *, dtype: str | None,
                    cuda_graph: bool | None = None) -> list[str]:
    """Reasons a layer-ops plugin cannot run the layers' element-wise ops here."""
    reasons = check_device(caps, device)
    reasons += _dtype_reason(dtype, caps.dtypes)
    if cuda_graph and not caps.cuda_graph:
        reasons.append("cannot be captured in CUDA graphs")
    return reasons


def check_grammar(caps: GrammarCaps, device: DeviceInfo, *, tokenizer: str = "hf",
                  jump_forward: bool = False) -> list[str]:
    """Reasons a grammar backend cannot constrain this engine's decoding (its package, the
    tokenizer kind it builds a vocabulary from, jump-forward when it is asked for)."""
    reasons = check_device(caps, device)
    if tokenizer not in caps.tokenizers:
        reasons.append(f"cannot read a {tokenizer} tokenizer (reads {_join(caps.tokenizers)})")
    if not caps.constraints:
        reasons.append("declares no constraint types")
    if jump_forward and not caps.jump_forward:
        reasons.append("cannot jump forward (--enable-jump-forward)")
    return reasons


def check_model(caps: ModelCaps, spec: ModelSpec) -> list[str]:
    """Reasons a model implementation cannot serve this architecture."""
    reasons = []
    if spec.architecture not in caps.architectures:
        reasons.append(f"does not implement {spec.architecture} "
                       f"(implements {_join(caps.architectures)})")
    if spec.attention_kind not in caps.attention_kinds:
        reasons.append(f"attention kind {spec.attention_kind} not implemented "
                       f"(implements {_join(caps.attention_kinds)})")
    return reasons


def check_spec(caps: SpecCaps, device: DeviceInfo, *, num_draft_tokens: int | None,
               tp_size: int, draft_model: str | None = None) -> list[str]:
    """Reasons a speculative proposer cannot run in this engine: its device and packages, a
    draft shape the engine verifies (chains), the draft length asked for, a draft model it
    needs and was not given (--speculative-draft-model-path) or one given to a proposer that
    runs none, tensor parallelism."""
    reasons = check_device(caps, device)
    if "chain" not in caps.draft_shapes:
        reasons.append(f"drafts {_join(caps.draft_shapes)} only; the engine verifies chains")
    if num_draft_tokens is not None and num_draft_tokens > caps.max_draft_tokens:
        reasons.append(f"proposes at most {caps.max_draft_tokens} draft tokens "
                       f"(--speculative-num-draft-tokens {num_draft_tokens})")
    if caps.needs_draft_weights and not draft_model:
        reasons.append("needs a draft model (--speculative-draft-model-path)")
    if draft_model and not caps.needs_draft_weights:
        reasons.append(f"runs no draft model (--speculative-draft-model-path {draft_model})")
    if tp_size > 1 and not caps.tensor_parallel:
        reasons.append(f"does not run under tensor parallelism (--tp-size {tp_size})")
    return reasons


def check_lora(caps: LoRACaps, device: DeviceInfo, *, dtype: str, quant_method: str | None,
               max_rank: int | None, tp_size: int) -> list[str]:
    """Reasons a LoRA backend cannot serve adapters here: its device and packages, the compute
    dtype, the base's quant method, the rank asked for, tensor parallelism."""
    reasons = check_device(caps, device)
    if dtype not in caps.dtypes:
        reasons.append(f"dtype {dtype} not supported (supports {_join(caps.dtypes)})")
    if quant_method is not None and quant_method not in caps.quant_methods:
        reasons.append(f"sits on {_join(caps.quant_methods)} base projections, not "
                       f"{quant_method} (the quant methods it declares)")
    if max_rank is not None and max_rank > caps.max_rank:
        reasons.append(f"ranks up to {caps.max_rank} (--max-lora-rank {max_rank})")
    if tp_size > 1 and not caps.tensor_parallel:
        reasons.append(f"does not shard adapters over tensor-parallel ranks (--tp-size "
                       f"{tp_size})")
    return reasons
