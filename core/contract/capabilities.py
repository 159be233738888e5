"""Value types of the plugin contract: what a plugin can do, what a device is.

This module is the one plugins import. Everything here is a frozen dataclass built from plain
Python values, so capabilities can be read (and plans made) without importing any kernel library.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from core.plan.quant_scheme import ONLINE_ACTIVATIONS, QuantScheme, online_scheme


def c_compiler() -> str | None:
    """The C compiler a capability's `programs=("cc",)` asks for, and the one a plugin builds
    its kernels with (plugins/_kit/cbuild.py): $CC, else cc / gcc / clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None

# Names used across the contract. Open strings are checked against these sets where they matter.
DEVICE_TYPES = ("cuda", "rocm", "xpu", "npu", "cpu")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")
PHASES = ("prefill", "decode")


def _frozen_map(value: Mapping | None) -> Mapping:
    return MappingProxyType(dict(value or {}))


def _frozenset(value: Iterable | None) -> frozenset:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(value)


class _Frozen:
    """Mixin: turns set/dict fields given as lists or dicts into immutable values."""

    _sets: tuple[str, ...] = ()
    _maps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self._sets:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _frozenset(value))
        for name in self._maps:
            object.__setattr__(self, name, _frozen_map(getattr(self, name)))


@dataclass(frozen=True)
class PageSizes:
    """Which KV page sizes a backend accepts: any, one of a set, or any multiple of a number."""

    mode: str = "any"  # "any" | "set" | "multiple"
    values: tuple[int, ...] = ()

    @classmethod
    def any(cls) -> PageSizes:
        return cls("any", ())

    @classmethod
    def of(cls, *sizes: int) -> PageSizes:
        return cls("set", tuple(sorted(sizes)))

    @classmethod
    def multiple_of(cls, n: int) -> PageSizes:
        return cls("multiple", (n,))

    def __post_init__(self) -> None:
        if self.mode not in ("any", "set", "multiple"):
            raise ValueError(f"PageSizes.mode must be any, set or multiple, not {self.mode!r}")
        if self.mode != "any" and not self.values:
            raise ValueError(f"PageSizes({self.mode!r}) needs at least one value")

    def accepts(self, size: int) -> bool:
        if self.mode == "any":
            return size >= 1
        if self.mode == "set":
            return size in self.values
        return size >= 1 and size % self.values[0] == 0

    def preferred(self) -> int:
        """The page size the backend would adopt when the user leaves it open."""
        if self.mode == "any":
            return 1
        return self.values[0]

    def describe(self) -> str:
        if self.mode == "any":
            return "any"
        if self.mode == "set":
            return "|".join(str(v) for v in self.values)
        return f"multiple of {self.values[0]}"


@dataclass(frozen=True)
class CapabilityRange:
    """An inclusive range of compute capability for one device type, e.g. CUDA sm80..sm90.

    For CUDA the number is major*10+minor (80 = sm80). For ROCm, archs names gfx targets.
    """

    min: int | None = None
    max: int | None = None
    archs: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.archs is not None:
            object.__setattr__(self, "archs", _frozenset(self.archs))

    def accepts(self, capability: int | None, arch: str | None) -> bool:
        if self.archs is not None and (arch is None or arch not in self.archs):
            return False
        if capability is None:
            return self.min is None and self.max is None
        if self.min is not None and capability < self.min:
            return False
        return not (self.max is not None and capability > self.max)

    def describe(self) -> str:
        parts = []
        if self.min is not None or self.max is not None:
            lo = f"sm{self.min}" if self.min is not None else ""
            hi = f"sm{self.max}" if self.max is not None else ""
            parts.append(f"{lo}-{hi}" if lo != hi else lo)
        if self.archs is not None:
            parts.append("|".join(sorted(self.archs)))
        return ",".join(parts) or "any"


@dataclass(frozen=True)
class DeviceInfo:
    """What a hardware target found (or what a simulated profile says).

    `features` holds names such as bf16, fp16, fp8, int8_mma, amx_bf16, amx_int8, amx_tile,
    avx512f, avx512_bf16, xmx, tensor_cores.
    """

    target: str  # name of the hardware plugin: cuda, rocm, xpu, npu, cpu, ...
    device_type: str  # torch device type: "cuda" for CUDA and ROCm, "xpu", "npu", "cpu"
    available: bool = True
    reason: str = ""  # why not available
    name: str = ""  # e.g. "NVIDIA H200"
    vendor: str = ""
    count: int = 0
    arch: str | None = None  # e.g. "sm90", "gfx942", "sapphirerapids"
    capability: int | None = None  # CUDA: major*10+minor
    memory_bytes: int = 0  # per device
    features: frozenset[str] = frozenset()
    dist_backend: str = ""  # nccl, rccl, xccl, hccl, gloo
    graph_capture: bool = False
    simulated: bool = False
    extra: Mapping[str, object] = field(default_factory=dict)  # a plugin's own facts, opaque

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", _frozenset(self.features))
        object.__setattr__(self, "extra", _frozen_map(self.extra))

    def has(self, feature: str) -> bool:
        return feature in self.features

    def describe(self) -> str:
        if not self.available:
            return f"{self.target}: unavailable ({self.reason})"
        mem = f"{self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else "? GiB"
        arch = f" {self.arch}" if self.arch else ""
        sim = " [simulated]" if self.simulated else ""
        return f"{self.target}: {self.count}x {self.name}{arch}, {mem}{sim}"


@dataclass(frozen=True)
class HardwareCaps(_Frozen):
    """Static facts of a hardware target plugin, known without probing."""

    device_type: str
    vendor: str = ""
    dist_backend: str = ""
    description: str = ""
    requires: tuple[str, ...] = ()  # python packages the probe needs (e.g. torch_npu)
    priority: int = 0  # which available target wins when --device is left open

    def summary(self) -> str:
        return f"device_type={self.device_type} dist={self.dist_backend or '-'}"


@dataclass(frozen=True)
class AttentionCaps(_Frozen):
    """What an attention backend supports. Every field is checked by the resolver.

    A backend declaring "MLA" in attention_kinds implements core.contract.mla (its factory
    returns an MLAAttentionBackend); for an MLA model `head_sizes` is checked against the
    latent width (kv_lora_rank + qk_rope_head_dim, 576 for DeepSeek-V2/V3), `kv_cache_dtypes`
    against the latent cache's dtype, `page_sizes` as for any backend (FlashMLA's 64).
    """

    devices: frozenset[str] = frozenset()  # targets: cuda, rocm, xpu, npu, cpu
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)  # per device
    cpu_isa: frozenset[str] = frozenset()  # features the CPU must have, e.g. {"amx_bf16"}
    dtypes: frozenset[str] = frozenset(COMPUTE_DTYPES)
    kv_cache_dtypes: frozenset[str] = frozenset(("float32", "float16", "bfloat16"))
    head_sizes: frozenset[int] | None = None  # None: any head size
    page_sizes: PageSizes = PageSizes()
    attention_kinds: frozenset[str] = frozenset(("MHA", "GQA", "MQA"))
    sliding_window: bool = False
    logit_softcap: bool = False
    sinks: bool = False
    phases: frozenset[str] = frozenset(PHASES)
    cuda_graph: bool = False
    # Its decode forward takes several rows of one request at consecutive positions (each row's
    # seq_len its own position + 1, all rows' K/V stored before any row attends): a speculative
    # verify step then runs as decode rows, inside the decode graphs (core.engine.model_runner).
    verify_rows: bool = False
    deterministic: bool = False
    requires: tuple[str, ...] = ()  # python packages imported by the factory
    programs: tuple[str, ...] = ()  # executables on PATH, e.g. ("cc",) to build its kernels
    # (with "cc", the factory may offer prebuild(): core/plan/prebuild.py compiles ahead)
    priority: Mapping[str, int] = field(default_factory=dict)  # per device target
    description: str = ""
    # Conditional needs: device features a KV-cache dtype needs beyond the backend's own range,
    # e.g. {"fp8_e4m3": {"fp8"}} for kernels that convert FP8 in hardware (sm89+ on CUDA).
    kv_cache_dtype_features: Mapping[str, frozenset[str]] = field(default_factory=dict)

    _sets = ("devices", "cpu_isa", "dtypes", "kv_cache_dtypes", "head_sizes", "attention_kinds",
             "phases")
    _maps = ("capability", "priority", "kv_cache_dtype_features")

    def summary(self) -> str:
        caps = ",".join(f"{d}:{r.describe()}" for d, r in sorted(self.capability.items()))
        heads = "any" if self.head_sizes is None else "|".join(map(str, sorted(self.head_sizes)))
        flags = [n for n in ("sliding_window", "logit_softcap", "sinks", "cuda_graph",
                             "verify_rows", "deterministic") if getattr(self, n)]
        return (f"devices={','.join(sorted(self.devices))}{' (' + caps + ')' if caps else ''} "
                f"kinds={','.join(sorted(self.attention_kinds))} "
                f"dtypes={','.join(sorted(self.dtypes))} kv={','.join(sorted(self.kv_cache_dtypes))} "
                f"heads={heads} pages={self.page_sizes.describe()} "
                f"phases={','.join(sorted(self.phases))} "
                f"{' '.join(flags)}").strip()


@dataclass(frozen=True)
class MoECaps(_Frozen):
    """What a MoE runner supports (the protocol is core.contract.moe). Every field is checked by the
    resolver against the model's MoESpec.

    quant_methods: names of the quant methods whose expert-weight form it runs (MoEWeights.form).
    quant_formats: the checkpoint formats (QuantScheme.format: fp8_block, fp8_channel, ...) it
    runs where it runs only some of a quant method's; empty: every format.
    activations: the gated activations it computes (core.contract.moe.ACTIVATIONS: silu, gelu,
    swigluoai). scoring_funcs: router scoring it implements (softmax, sigmoid). max_experts /
    max_top_k: limits of its kernels (None: none). cuda_graph: a decode-sized forward may be
    captured.
    """

    devices: frozenset[str] = frozenset()
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    dtypes: frozenset[str] = frozenset(COMPUTE_DTYPES)
    quant_methods: frozenset[str] = frozenset(("unquantized",))
    quant_formats: frozenset[str] = frozenset()
    activations: frozenset[str] = frozenset(("silu",))
    scoring_funcs: frozenset[str] = frozenset(("softmax",))
    grouped_topk: bool = False
    shared_experts: bool = False
    max_experts: int | None = None
    max_top_k: int | None = None
    cuda_graph: bool = False
    deterministic: bool = False
    requires: tuple[str, ...] = ()
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""
    # Runs one expert-parallel rank's share: weights of experts [expert_offset, + local) only,
    # routing over all of them (MoELayerParams.expert_offset / num_local_experts, core.contract.moe).
    expert_parallel: bool = False
    # Routes with a per-expert correction bias (DeepSeek-V3's noaux_tc: experts chosen on
    # scores + bias, groups ranked by their top-2 sum, weights the unbiased scores;
    # MoELayerParams.correction_bias).
    correction_bias: bool = False
    # Adds per-expert biases to the gate/up and down products (GPT-OSS; MoEWeights.extra
    # "w13_bias" / "w2_bias", core.contract.moe).
    expert_bias: bool = False

    _sets = ("devices", "cpu_isa", "dtypes", "quant_methods", "quant_formats", "activations",
             "scoring_funcs")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        flags = [n for n in ("grouped_topk", "correction_bias", "expert_bias", "shared_experts",
                             "cuda_graph", "expert_parallel") if getattr(self, n)]
        limits = [f"{n}={getattr(self, n)}" for n in ("max_experts", "max_top_k")
                  if getattr(self, n) is not None]
        return (f"devices={','.join(sorted(self.devices))} dtypes={','.join(sorted(self.dtypes))} "
                f"quant={','.join(sorted(self.quant_methods))} "
                f"act={','.join(sorted(self.activations))} "
                f"scoring={','.join(sorted(self.scoring_funcs))} "
                f"{' '.join(limits + flags)}").strip()


@dataclass(frozen=True)
class QuantCaps(_Frozen):
    """What a quantization method supports (the protocol is core.contract.quant).

    `config_names` are the quant_method strings of a HF quantization_config it can load
    ("none" for unquantized checkpoints). `formats` are the weight formats it computes
    (core.contract.quant.FORMATS: fp8_block, int4_awq, ..., or a method's own name for a quant_method
    core does not parse); `activation_schemes` none (weight-only) / dynamic / static (empty:
    not checked); `group_sizes` the weight group sizes it takes (empty: any).
    `online_format`: the format it quantizes a dense checkpoint into when asked with
    --quantization NAME (None: it only loads quantized checkpoints; never chosen on its own for
    a dense one): one of core's (fp8_channel, fp8_tensor, int8_channel: 8-bit) or any name of
    its own (its bits: its one `weight_bits`). `online_activations`: what that does to the
    activations, "dynamic" (W8A8: per-token scales at run time) or "none" (weight-only: x stays
    in the compute dtype); None: "none" when `activation_schemes` lists none but not dynamic,
    else "dynamic". The online format must be among `formats` (if any), its activations among
    `activation_schemes` (if any) and its bits among `weight_bits` (if any): `online_scheme()`
    is the scheme the method is then built with, and `declaration_errors()` says what does not
    hold together (the resolver gives it as the reason, the conformance suite fails on it).
    `moe_runners`: MoE runners known to run its expert weights (the agreement
    holds when either this or the runner's MoECaps.quant_methods names the other).
    """

    devices: frozenset[str] = frozenset()
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    config_names: frozenset[str] = frozenset()
    formats: frozenset[str] = frozenset()  # empty: whatever its config_names' checkpoints hold
    activation_schemes: frozenset[str] = frozenset()
    group_sizes: frozenset[int] = frozenset()
    online_format: str | None = None
    online_activations: str | None = None  # "dynamic" | "none"; None: from activation_schemes
    dtypes: frozenset[str] = frozenset(COMPUTE_DTYPES)  # activation / compute dtypes
    weight_bits: frozenset[int] = frozenset()
    moe: bool = False  # can quantize MoE expert weights
    moe_runners: frozenset[str] = frozenset()
    needs_features: frozenset[str] = frozenset()  # device features, e.g. {"fp8"}
    requires: tuple[str, ...] = ()
    programs: tuple[str, ...] = ()  # executables on PATH, e.g. ("cc",) to build its kernels
    # (with "cc", the factory may offer prebuild(): core/plan/prebuild.py compiles ahead)
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""
    # Its weights load split over tensor-parallel ranks: the core hands a rank's loader the
    # rank's rows (column-parallel) or inputs (row-parallel) of each checkpoint tensor
    # (core.layers.linear.tp_narrow), which the method must take as a smaller whole weight.
    tensor_parallel: bool = False
    # It gives a loaded layer's weight back dense (QuantMethod.dense_weight), exactly: what a
    # checkpoint that quantizes MLA's kv_b_proj needs (the model holds that weight dense).
    dense_weights: bool = False

    _sets = ("devices", "cpu_isa", "config_names", "formats", "activation_schemes",
             "group_sizes", "dtypes", "weight_bits", "moe_runners", "needs_features")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        online = ""
        if self.online_format:
            weight_only = " weight-only" if self._online_acts() == "none" else ""
            online = f" online={self.online_format}{weight_only}"
        return (f"devices={','.join(sorted(self.devices))} "
                f"loads={','.join(sorted(self.config_names))} "
                f"formats={','.join(sorted(self.formats))}{online} "
                f"dtypes={','.join(sorted(self.dtypes))}{' moe' if self.moe else ''}")

    def _online_acts(self) -> str:
        if self.online_activations is not None:
            return self.online_activations
        only_none = bool(self.activation_schemes) and "dynamic" not in self.activation_schemes \
            and "none" in self.activation_schemes
        return "none" if only_none else "dynamic"

    def _online_bits(self) -> int | None:
        return next(iter(self.weight_bits)) if len(self.weight_bits) == 1 else None

    def online_scheme(self) -> QuantScheme | None:
        """The scheme a dense checkpoint gets with --quantization NAME (None: no online
        format); ValueError naming every declaration_errors() entry."""
        errors = self.declaration_errors()
        if errors:
            raise ValueError("; ".join(errors))
        if self.online_format is None:
            return None
        return online_scheme(self.online_format, self._online_acts(), self._online_bits())

    def declaration_errors(self) -> list[str]:
        """What these caps declare that cannot hold together (empty: nothing), each saying
        which fields disagree: today, the online quantization's (see the class doc)."""
        errors = []
        acts, fmt = self._online_acts(), self.online_format
        if acts not in ONLINE_ACTIVATIONS:
            errors.append(f"online_activations {acts!r} is neither 'dynamic' nor 'none' "
                          "(static scales need a calibrated checkpoint)")
        if fmt is None:
            if self.online_activations is not None:
                errors.append("online_activations is set but online_format is None")
            return errors
        if not isinstance(fmt, str) or not fmt or fmt == "dense":
            return [*errors, f"online_format {fmt!r} names no format the weights become"]
        if self.formats and fmt not in self.formats:
            errors.append(f"online_format {fmt!r} is not among its formats "
                          f"({', '.join(sorted(self.formats))}): it would refuse the weights "
                          "it makes")
        if self.activation_schemes and acts not in self.activation_schemes:
            unset = "" if self.online_activations is not None else " (online_activations unset)"
            errors.append(f"its online quantization's {acts} activations{unset} are not among "
                          f"its activation_schemes ({', '.join(sorted(self.activation_schemes))})")
        if not errors:
            bits = online_scheme(fmt, acts, self._online_bits()).weight_bits
            if self.weight_bits and bits not in self.weight_bits:
                errors.append(f"online_format {fmt!r} holds {bits}-bit weights, not among its "
                              f"weight_bits ({', '.join(map(str, sorted(self.weight_bits)))})")
        return errors


@dataclass(frozen=True)
class ModelCaps(_Frozen):
    """A model architecture implementation: the HF `architectures` names it serves.

    lora_modules: the HF projection names (q_proj, ..., down_proj) LoRA adapters may target in
    it (the model's `lora_targets()` maps them onto its layers); empty: it takes no adapters.
    """

    architectures: frozenset[str] = frozenset()
    attention_kinds: frozenset[str] = frozenset(("MHA", "GQA", "MQA"))
    lora_modules: frozenset[str] = frozenset()
    description: str = ""

    _sets = ("architectures", "attention_kinds", "lora_modules")

    def summary(self) -> str:
        return f"architectures={','.join(sorted(self.architectures))}"


@dataclass(frozen=True)
class LayerOpsCaps(_Frozen):
    """What a layer-ops plugin (core.contract.layer_ops) provides: fused element-wise kernels.

    ops: which of core.contract.layer_ops.OPS it implements (the reference runs the others).
    cuda_graph: its ops never sync with the host, so decode graphs may capture them.
    """

    devices: frozenset[str] = frozenset()
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    dtypes: frozenset[str] = frozenset(COMPUTE_DTYPES)
    ops: frozenset[str] = frozenset()
    cuda_graph: bool = False
    requires: tuple[str, ...] = ()
    programs: tuple[str, ...] = ()  # executables on PATH, e.g. ("cc",) to build its kernels
    # (with "cc", the factory may offer prebuild(): core/plan/prebuild.py compiles ahead)
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""

    _sets = ("devices", "cpu_isa", "dtypes", "ops")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        return (f"devices={','.join(sorted(self.devices))} dtypes={','.join(sorted(self.dtypes))} "
                f"ops={','.join(sorted(self.ops))}{' cuda_graph' if self.cuda_graph else ''}")


CONSTRAINT_TYPES = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")


@dataclass(frozen=True)
class GrammarCaps(_Frozen):
    """What a grammar backend (structured output; the protocol is core.contract.grammar) supports.

    constraints: which of CONSTRAINT_TYPES it compiles. schema_lacks: JSON-schema keywords it
    would accept but not enforce (a request whose schema uses one is refused, never run
    loosely). tokenizers: tokenizer kinds it can build a vocabulary from ("hf": a transformers
    tokenizer, what core.tokenizer wraps). jump_forward: its matchers implement
    `jump_forward()` (the tokens the grammar forces next; --enable-jump-forward needs it).
    serialize: the backend implements `serialize(compiled) -> bytes` and `deserialize(bytes)
    -> compiled`, so the engine's compile process sends its result back; without it the
    worker compiles again after the compile process proved the constraint safe (twice the
    work). Grammar work runs on the host, so devices is "*" for a backend whose bitmask the core
    applies on any device.
    """

    constraints: frozenset[str] = frozenset()
    schema_lacks: frozenset[str] = frozenset()
    tokenizers: frozenset[str] = frozenset(("hf",))
    jump_forward: bool = False
    serialize: bool = False
    devices: frozenset[str] = frozenset(("*",))
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    requires: tuple[str, ...] = ()
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""

    _sets = ("constraints", "schema_lacks", "tokenizers", "devices", "cpu_isa")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        lacks = f" schema_lacks={','.join(sorted(self.schema_lacks))}" if self.schema_lacks \
            else ""
        jf = " jump_forward" if self.jump_forward else ""
        ser = " serialize" if self.serialize else ""
        return (f"constraints={','.join(c for c in CONSTRAINT_TYPES if c in self.constraints)}"
                f"{lacks} tokenizers={','.join(sorted(self.tokenizers))}{jf}{ser}")


@dataclass(frozen=True)
class ToolParserCaps(_Frozen):
    """What a tool-call parser (tool calling in chat; the protocol is core.contract.tools) fits.

    markers: text whose presence in a chat template says the model writes this format; under
    --tool-call-parser auto the best-priority parser whose markers the template holds is chosen.
    families: the model families (HF model_type) that write it, for the plan and the docs only
    (a family never picks a parser: SmolLM2 and Llama-3.1 are both `llama`). aliases: the names
    SGLang and vLLM give the same format (--tool-call-parser accepts them). arguments_key: the
    key its calls hold the arguments under ("arguments", "parameters"); `tool_choice: required`
    constrains calls to that shape. prompts: it can offer tools in a system message (its
    tools_prompt), for chat templates that ignore `tools`; the best-priority parser that
    prompts is auto's choice for a template with no tool markup. parallel_calls: its format
    holds several calls in one answer (OpenAI's parallel_tool_calls; False: one call per answer,
    and the conformance suite skips its several-call cases). reads: marker texts it reads
    that may be special tokens' (gpt-oss's harmony markers): where the tokenizer's special
    tokens include one, a request it reads calls from is detokenized with skip_special_tokens
    false (as ReasoningParserCaps.reads). Parsers are pure Python text work: no device, no
    package beyond `requires`.
    """

    markers: tuple[str, ...] = ()
    families: frozenset[str] = frozenset()
    aliases: frozenset[str] = frozenset()
    arguments_key: str = "arguments"
    prompts: bool = False
    parallel_calls: bool = True
    reads: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    priority: int = 0
    description: str = ""

    _sets = ("families", "aliases")

    def summary(self) -> str:
        aka = f" aliases={','.join(sorted(self.aliases))}" if self.aliases else ""
        return (f"markers={','.join(self.markers) or '-'} families="
                f"{','.join(sorted(self.families)) or '-'}{aka} arguments_key="
                f"{self.arguments_key}{' prompts' if self.prompts else ''}"
                f"{'' if self.parallel_calls else ' one-call'}")


DRAFT_SHAPES = ("chain", "tree")


@dataclass(frozen=True)
class SpecCaps(_Frozen):
    """What a speculative-decoding proposer (the protocol is core.contract.spec) can do.

    devices: where its drafting runs ("*": on the host, whatever the target). draft_shapes:
    "chain" (one sequence of drafts per request) and/or "tree" (the engine verifies chains
    only in this release, so a proposer must offer "chain"). max_draft_tokens: the most drafts
    it proposes per request and step (--speculative-num-draft-tokens above it is refused).
    needs_draft_weights: it runs a draft model (--speculative-draft-model-path needed): the
    engine loads it, with a KV pool of its own, and gives it as SpecConfig.draft.
    graph_safe: its drafting can sit inside a captured graph. grammars: its drafts may be
    checked against a grammar matcher and rolled back (else constrained requests decode
    without speculation, with a note). tensor_parallel: it runs under --tp-size > 1.
    aliases: other names for it (SGLang's and vLLM's spellings; matched case-insensitively).
    """

    devices: frozenset[str] = frozenset(("*",))
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    draft_shapes: frozenset[str] = frozenset(("chain",))
    max_draft_tokens: int = 8
    needs_draft_weights: bool = False
    graph_safe: bool = False
    grammars: bool = False
    tensor_parallel: bool = False
    aliases: frozenset[str] = frozenset()
    requires: tuple[str, ...] = ()
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""

    _sets = ("devices", "cpu_isa", "draft_shapes", "aliases")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        flags = [f for f, on in (("draft_weights", self.needs_draft_weights),
                                 ("graph_safe", self.graph_safe), ("grammars", self.grammars),
                                 ("tp", self.tensor_parallel)) if on]
        return (f"devices={','.join(sorted(self.devices))} shapes="
                f"{','.join(s for s in DRAFT_SHAPES if s in self.draft_shapes)} "
                f"max_draft_tokens={self.max_draft_tokens}"
                + (f" {' '.join(flags)}" if flags else ""))


@dataclass(frozen=True)
class ReasoningParserCaps(_Frozen):
    """What a reasoning parser (`reasoning_content` in chat; the protocol is
    core.contract.reasoning) reads and fits.

    markers: text whose presence in a chat template says the model writes this format; under
    --reasoning-parser auto the parsers whose markers the template holds all fit, and the one
    holding the most of them (the most specific), then the best priority, is chosen (Qwen3's
    template holds `<think>` and `enable_thinking`, DeepSeek-R1's only `<think>`). reads: every
    marker the parser takes out of the text (none reaches a response; the conformance suite
    checks it); a marker that is a special token's text makes the core keep special tokens
    when it detokenizes. starts_in_reasoning: the model may begin inside its reasoning without
    writing the start marker (DeepSeek-R1: its template puts `<think>` in the prompt), so an
    output with no marker is all reasoning. thinking_kwarg: the chat-template variable that
    switches thinking (Qwen3's `enable_thinking`): a request whose chat_template_kwargs set it
    to false is not split (its output is all content); None: thinking cannot be switched off.
    families and aliases as ToolParserCaps'. Parsers are pure Python text work: no device, no
    package beyond `requires`.
    """

    markers: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    starts_in_reasoning: bool = False
    thinking_kwarg: str | None = None
    families: frozenset[str] = frozenset()
    aliases: frozenset[str] = frozenset()
    requires: tuple[str, ...] = ()
    priority: int = 0
    description: str = ""

    _sets = ("families", "aliases")

    def summary(self) -> str:
        aka = f" aliases={','.join(sorted(self.aliases))}" if self.aliases else ""
        switch = f" thinking_kwarg={self.thinking_kwarg}" if self.thinking_kwarg else ""
        return (f"markers={','.join(self.markers) or '-'} reads={','.join(self.reads) or '-'}"
                f"{' starts_in_reasoning' if self.starts_in_reasoning else ''}{switch}{aka}")


@dataclass(frozen=True)
class LoRACaps(_Frozen):
    """What a LoRA backend (multi-LoRA serving; the protocol is core.contract.lora) can do.

    devices / capability / cpu_isa: where its kernels run. dtypes: the compute dtypes of the
    activations and adapter buffers it takes. max_rank: the largest adapter rank its kernels
    take (--max-lora-rank above it is refused). graph_safe: it serves device-only steps
    (core.contract.lora: one token per segment, slots only on the device, any bucket size) with
    no host sync, so decode graphs capture its prepare and apply and replay them for every
    step, adapters or not (the resolver turns graphs off for a backend that is not).
    quant_methods: the quant methods (QuantCaps names) of base projections it sits on: the
    delta is added to whatever the base computes; the resolver refuses it on any other (name
    only those whose outputs it was checked on).
    tensor_parallel: it runs adapters sharded like their base layers (--tp-size > 1).
    """

    devices: frozenset[str] = frozenset()
    capability: Mapping[str, CapabilityRange] = field(default_factory=dict)
    cpu_isa: frozenset[str] = frozenset()
    dtypes: frozenset[str] = frozenset(COMPUTE_DTYPES)
    max_rank: int = 64
    graph_safe: bool = False
    quant_methods: frozenset[str] = frozenset(("unquantized",))
    tensor_parallel: bool = False
    requires: tuple[str, ...] = ()
    priority: Mapping[str, int] = field(default_factory=dict)
    description: str = ""

    _sets = ("devices", "cpu_isa", "dtypes", "quant_methods")
    _maps = ("capability", "priority")

    def summary(self) -> str:
        flags = [f for f, on in (("graph_safe", self.graph_safe),
                                 ("tp", self.tensor_parallel)) if on]
        return (f"devices={','.join(sorted(self.devices))} dtypes={','.join(sorted(self.dtypes))} "
                f"max_rank={self.max_rank} quant={','.join(sorted(self.quant_methods))}"
                + (f" {' '.join(flags)}" if flags else ""))


KINDS = ("hardware", "attention", "moe", "quant", "models", "layer_ops", "grammar",
         "tool_parser", "spec", "reasoning_parser", "lora")
# the caps of any kind (a registration holds its kind's: CAPS_TYPES[kind])
Caps = (HardwareCaps | AttentionCaps | MoECaps | QuantCaps | ModelCaps | LayerOpsCaps
        | GrammarCaps | ToolParserCaps | SpecCaps | ReasoningParserCaps | LoRACaps)

CAPS_TYPES: dict[str, type[Caps]] = {
    "hardware": HardwareCaps,
    "attention": AttentionCaps,
    "moe": MoECaps,
    "quant": QuantCaps,
    "models": ModelCaps,
    "layer_ops": LayerOpsCaps,
    "grammar": GrammarCaps,
    "tool_parser": ToolParserCaps,
    "spec": SpecCaps,
    "reasoning_parser": ReasoningParserCaps,
    "lora": LoRACaps,
}
