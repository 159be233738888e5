"""Model spec: what the resolver needs to know about a model, read from its HF config alone.

`load_model_spec(path)` takes a model directory, a config.json, or a .gguf file; no weight is read.
Architectures known to the installed transformers are read through its config class, so the
defaults and derived fields (Qwen2's `layer_types`, Gemma-2's alternating windows) follow its
semantics; any other architecture is read from the usual config.json names, and what had to be
assumed is said in `ModelSpec.unread`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.contract.json_types import JSONObject

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoESpec:
    """The experts of a MoE model: what a MoE runner must be able to run.

    renormalize: the k selected weights are divided by their sum (norm_topk_prob; Mixtral and
    GPT-OSS always: GPT-OSS's softmax over the k best logits is the renormalized softmax).
    scoring_func: softmax over the experts, or a sigmoid each (DeepSeek-V3).
    activation: the experts' gated activation (core.contract.moe.ACTIVATIONS: silu, gelu, or
    swigluoai, GPT-OSS's clamped SwiGLU with swiglu_alpha / swiglu_limit).
    expert_bias: each expert's projections have biases (GPT-OSS). The router's own bias
    (GPT-OSS's too) is the model's business: a runner gets the biased logits.
    shared_expert_gate: Qwen2-MoE's per-token sigmoid gate on its shared expert.
    moe_layers: the layers that hold experts (the others are dense MLPs: decoder_sparse_step,
    mlp_only_layers, first_k_dense_replace); empty when the layer count is unknown.
    """

    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    intermediate_size: int | None = None
    grouped_topk: bool = False  # DeepSeek-style group-limited routing
    num_groups: int | None = None
    topk_groups: int | None = None
    activation: str = "silu"
    renormalize: bool = True
    scoring_func: str = "softmax"
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    routed_scaling_factor: float = 1.0
    moe_layers: tuple[int, ...] = ()
    # DeepSeek-V3's noaux_tc: experts chosen on scores + e_score_correction_bias
    correction_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None  # swigluoai's constants (None for other activations)
    swiglu_limit: float | None = None


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
    # (q_lora_rank is None where queries are not compressed, as in DeepSeek-V2-Lite)
    mla: dict[str, int | None] | None = None
    moe: MoESpec | None = None
    quantization: JSONObject | None = None  # the HF quantization_config as given
    quant_method: str = "none"  # quantization_config["quant_method"], or "none"
    tie_word_embeddings: bool = False
    rope_scaling: JSONObject | None = None
    intermediate_size: int | None = None  # the dense MLP's (None: not in the config)
    unread: tuple[str, ...] = ()
    source: str = ""

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


# ---- reading ----------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
# attention with learned per-head sink logits; no config flag says so, the architecture does
_SINK_MODEL_TYPES = frozenset({"gpt_oss"})
# MoE experts with biases on their projections (likewise said by the architecture alone)
_EXPERT_BIAS_MODEL_TYPES = frozenset({"gpt_oss"})
SWIGLU_ALPHA = 1.702  # GPT-OSS's, where a config leaves swiglu_alpha out (4.55's did)
# usual config.json names, first found wins (for architectures transformers does not know)
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv",
             "multi_query_group_num")
_VOCAB = ("vocab_size", "padded_vocab_size")
_CONTEXT = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
            "max_sequence_length")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_top_k")


class _Fields:
    """Looks a config field up: transformers' config objects first, then the raw JSON dicts.

    A field a config object has is authoritative even when None (Qwen2 sets `sliding_window`
    to None when `use_sliding_window` is false, while config.json still holds a number).
    """

    def __init__(self, objs: list[PretrainedConfig], dicts: list[JSONObject], where: str):
        self.objs, self.dicts, self.where = objs, dicts, where

    def get(self, name: str) -> Any:  # whatever the config holds (read by attribute)
        for obj in self.objs:
            try:
                if hasattr(obj, name):
                    return getattr(obj, name)
            except Exception as e:  # transformers refuses per-layer fields read as one value
                raise ValueError(f"{self.where}: {name} cannot be read as one value for the "
                                 f"whole model ({type(e).__name__}: {e})") from e
        for d in self.dicts:
            if name in d:
                return d[name]
        return None

    def first(self, names: tuple[str, ...]) -> tuple[str | None, Any]:
        for name in names:
            value = self.get(name)
            if value is not None:
                return name, value
        return None, None


def _transformers_config(model_type: str, raw: JSONObject
                         ) -> tuple[PretrainedConfig | None, str | None]:
    """transformers' config object for `raw`, or (None, why not)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None, (f"model_type {model_type!r} unknown to transformers "
                      f"{transformers.__version__}: fields read by their usual config.json names")
    try:
        # from_dict never runs remote code: `auto_map` entries are ignored here
        return CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(raw)), None
    except Exception as e:  # a config transformers rejects is still read, and the reason kept
        return None, (f"transformers {transformers.__version__} rejected the config "
                      f"({type(e).__name__}: {e}): fields read by their usual config.json names")


def _causal_lm_class(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _dtype_name(value: object, notes: list[str]) -> str | None:
    if value is None:
        notes.append("dtype missing: no torch_dtype / dtype in the config")
        return None
    name = str(value).removeprefix("torch.").lower()
    if name not in _DTYPE_NAMES:
        notes.append(f"dtype {value!r} not understood: left unset")
        return None
    return _DTYPE_NAMES[name]


def _rope_scaling(raw: JSONObject) -> JSONObject | None:
    """The config's rope scaling as given (transformers 5 saves it as `rope_parameters`)."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not isinstance(scaling, dict):
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:  # the older name of the same key
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type", "default") == "default" and "factor" not in scaling:
        return None
    return scaling


def _sliding_windows(f: _Fields, num_layers: int, known: bool, notes: list[str],
                     where: str) -> tuple[int | None, ...]:
    window = f.get("sliding_window") or None  # 0 means none in some configs
    layer_types = f.get("layer_types")
    if layer_types:  # authoritative wherever present (Gemma-2/3, GPT-OSS, Qwen2/3 in transformers)
        if len(layer_types) != num_layers:
            raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        if window is None and "sliding_attention" in layer_types:
            notes.append("layer_types has sliding_attention layers but sliding_window is missing: "
                         "those layers read as full attention")
        other = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if other:  # e.g. chunked_attention (Llama-4), linear_attention: not a sliding window
            notes.append(f"layer_types {', '.join(other)} not modelled: read as full attention")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    use = f.get("use_sliding_window")
    if use is False or window is None:
        return (None,) * num_layers
    first = f.get("max_window_layers")
    if not known and use is True and isinstance(first, int):
        # Qwen2 semantics, for configs transformers does not know: layers from max_window_layers on
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral / Mixtral / Qwen3-MoE: every layer


def moe_layer_ids(num_layers: int, sparse_step: int | None = None,
                  mlp_only_layers: Iterable[int] | None = None, first_k_dense: int | None = None
                  ) -> tuple[int, ...]:
    """The layers holding experts: every `sparse_step`-th (Qwen2-MoE counts from 1), minus
    `mlp_only_layers`, minus the first `first_k_dense` (DeepSeek)."""
    step = sparse_step or 1
    dense = set(mlp_only_layers or ())
    return tuple(i for i in range(num_layers)
                 if (i + 1) % step == 0 and i not in dense and i >= (first_k_dense or 0))


def _moe(f: _Fields, notes: list[str], num_layers: int = 0) -> MoESpec | None:
    _, experts = f.first(_EXPERTS)
    if not isinstance(experts, int) or experts <= 1:
        return None
    _, top_k = f.first(_TOP_K)
    if top_k is None:
        notes.append("num_experts_per_tok missing: MoE top-k assumed 1")
        top_k = 1
    shared = f.get("n_shared_experts") or 0
    shared_size = f.get("shared_expert_intermediate_size") or None
    if not shared and (shared_size or 0) > 0:
        shared = 1  # Qwen2-MoE: one shared expert, sized by shared_expert_intermediate_size
    inter = f.get("moe_intermediate_size") or f.get("intermediate_size")
    if shared and shared_size is None and inter:
        shared_size = int(shared) * int(inter)  # DeepSeek: n_shared experts as one wide MLP
    norm = f.get("norm_topk_prob")
    method = f.get("topk_method")
    if method is None and f.get("model_type") == "deepseek_v3":
        method = "noaux_tc"  # transformers' DeepseekV3 routes so whatever the config says
    scoring = str(f.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax"))
    groups, topk_groups = f.get("n_group"), f.get("topk_group")
    grouped = ((groups or 1) > 1 or (topk_groups or 1) > 1
               or method == "group_limited_greedy")
    # GPT-OSS experts use a clamped SwiGLU with its own alpha, not plain SiLU gating
    limit = f.get("swiglu_limit")
    activation = "swigluoai" if limit is not None else (f.get("hidden_act") or "silu")
    alpha = f.get("swiglu_alpha") if limit is not None else None
    return MoESpec(
        num_experts=experts,
        top_k=int(top_k),
        num_shared_experts=int(shared),
        intermediate_size=inter,
        grouped_topk=bool(grouped),
        num_groups=groups,
        topk_groups=topk_groups,
        activation=str(activation),
        # no norm_topk_prob field: Mixtral-style routing, which renormalizes
        renormalize=True if norm is None else bool(norm),
        scoring_func=scoring,
        shared_expert_intermediate_size=int(shared_size) if shared_size else None,
        shared_expert_gate=bool(f.get("shared_expert_intermediate_size")),
        routed_scaling_factor=float(f.get("routed_scaling_factor") or 1.0),
        correction_bias=method == "noaux_tc",
        expert_bias=f.get("model_type") in _EXPERT_BIAS_MODEL_TYPES,
        swiglu_alpha=None if limit is None else float(alpha or SWIGLU_ALPHA),
        swiglu_limit=None if limit is None else float(limit),
        moe_layers=moe_layer_ids(num_layers, f.get("decoder_sparse_step"),
                                 f.get("mlp_only_layers"), f.get("first_k_dense_replace")),
    )


def _quantization(f: _Fields, raw: JSONObject,
                  notes: list[str]) -> tuple[JSONObject | None, str]:
    q = raw.get("quantization_config") or f.get("quantization_config")
    if q is None and isinstance(raw.get("compression_config"), dict):
        q = {"quant_method": "compressed-tensors", **raw["compression_config"]}  # older name
    if q is None:
        return None, "none"
    if not isinstance(q, dict):  # a transformers QuantizationConfig object
        q = q.to_dict()
    method = q.get("quant_method")
    if not method:
        notes.append("quantization_config has no quant_method: method unknown")
        return dict(q), "unknown"
    return dict(q), str(method).lower()


def spec_from_config(config: JSONObject | PretrainedConfig, source: str = "") -> ModelSpec:
    """Derive a ModelSpec from a HF config (a config.json dict or a transformers config)."""
    where = source or "config"
    if isinstance(config, dict):
        raw, cfg = config, None
    elif hasattr(config, "to_dict") and hasattr(config, "model_type"):
        raw, cfg = config.to_dict(), config
    else:
        raise TypeError(f"{where}: expected a config dict or a transformers PretrainedConfig, "
                        f"got {type(config).__name__}")
    notes: list[str] = []
    model_type = str(raw.get("model_type") or getattr(cfg, "model_type", "") or "")
    if cfg is None and model_type:
        cfg, why = _transformers_config(model_type, raw)
        if why:
            notes.append(why)
    elif not model_type:
        notes.append("model_type missing: fields read by their usual config.json names")
    known = cfg is not None

    # multimodal checkpoints keep the language model's fields in a text config
    objs: list[PretrainedConfig] = []
    if cfg is not None:
        try:
            text = cfg.get_text_config()
        except (AttributeError, ValueError):  # older transformers; several text configs
            text = cfg
        objs = [text] if text is cfg else [text, cfg]
    dicts = [raw["text_config"], raw] if isinstance(raw.get("text_config"), dict) else [raw]
    f = _Fields(objs, dicts, where)

    archs = raw.get("architectures") or getattr(cfg, "architectures", None)
    if archs:
        architecture = str(archs[0])
    else:
        architecture = (_causal_lm_class(model_type) or "") if model_type else ""
        if not architecture:
            raise ValueError(f"{where}: neither architectures nor a model_type transformers "
                             "maps to a causal-LM class: cannot tell what model this is")
        notes.append(f"architectures missing: {architecture}, transformers' causal-LM class "
                     f"for model_type {model_type!r}")

    required = {"num_hidden_layers": _LAYERS, "hidden_size": _HIDDEN,
                "num_attention_heads": _HEADS, "vocab_size": _VOCAB}
    values = {key: f.first(names)[1] for key, names in required.items()}
    missing = [key for key, value in values.items() if not isinstance(value, int)]
    if missing:
        raise ValueError(f"{where}: config lacks {', '.join(missing)} (or they are not integers)")
    num_layers, hidden, heads, vocab = (values[k] for k in required)

    _, kv_heads = f.first(_KV_HEADS)
    if kv_heads is None:
        kv_heads = heads
        notes.append(f"num_key_value_heads missing: assumed MHA (= num_attention_heads = {heads})")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads ({kv_heads}) must divide "
                         f"num_attention_heads ({heads})")

    mla = None
    if f.get("kv_lora_rank") is not None:
        mla = {k: f.get(k) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                     "qk_rope_head_dim", "v_head_dim")}
        absent = [k for k, v in mla.items() if v is None and k != "q_lora_rank"]
        if absent:
            raise ValueError(f"{where}: MLA config (kv_lora_rank set) lacks {', '.join(absent)}")
        attention_kind = "MLA"
        # the query/key head is the no-rope part plus the rope part; values have their own size
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        v_head_dim = mla["v_head_dim"]
    else:
        attention_kind = ("MQA" if kv_heads == 1 else "MHA" if kv_heads == heads else "GQA")
        head_dim = f.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{where}: no head_dim, and hidden_size ({hidden}) is not a "
                                 f"multiple of num_attention_heads ({heads})")
            head_dim = hidden // heads
            if not known:
                notes.append(f"head_dim missing: assumed hidden_size / num_attention_heads "
                             f"= {head_dim}")
        v_head_dim = f.get("v_head_dim") or head_dim

    _, context = f.first(_CONTEXT)
    if context is None:
        context = 0
        notes.append("max_position_embeddings missing: context length unknown (0)")

    dtype_value = next((v for v in (getattr(o, "dtype", None) for o in objs) if v is not None),
                       None) or raw.get("torch_dtype") or raw.get("dtype")

    tie = f.get("tie_word_embeddings")
    if tie is None:
        tie = False
        notes.append("tie_word_embeddings missing: assumed False")

    sinks = model_type in _SINK_MODEL_TYPES
    if not known:
        notes.append("attention sinks unknown for this architecture: assumed none")
    windows = _sliding_windows(f, num_layers, known, notes, where)
    quantization, quant_method = _quantization(f, raw, notes)
    moe = _moe(f, notes, num_layers)
    return ModelSpec(
        architecture=architecture,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        v_head_dim=int(v_head_dim),
        attention_kind=attention_kind,
        vocab_size=vocab,
        context_length=int(context),
        dtype=_dtype_name(dtype_value, notes),
        sliding_windows=windows,
        logit_softcap=f.get("attn_logit_softcapping") or None,
        final_logit_softcap=f.get("final_logit_softcapping") or None,
        attention_sinks=sinks,
        mla=mla,
        moe=moe,
        quantization=quantization,
        quant_method=quant_method,
        tie_word_embeddings=bool(tie),
        rope_scaling=_rope_scaling(raw),
        intermediate_size=int(f.get("intermediate_size")) if f.get("intermediate_size")
        else None,
        unread=tuple(notes),
        source=source,
    )


def _read_json(path: str) -> JSONObject:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a JSON object, got {type(data).__name__}")
    return data


def load_model_spec(path: str) -> ModelSpec:
    """Read the spec of the model at `path`: a directory holding config.json (or a single .gguf),
    a config JSON file, or a .gguf file (its metadata only)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config_json = os.path.join(path, "config.json")
        if os.path.isfile(config_json):
            return _config_spec(config_json)
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return load_model_spec(os.path.join(path, ggufs[0]))
        found = f" (it holds {len(ggufs)} .gguf files: name one)" if ggufs else ""
        raise FileNotFoundError(f"no config.json in model directory {path}{found}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}")
    if path.endswith(".gguf"):
        return _gguf_spec(path)
    if path.endswith(".json"):
        return _config_spec(path)
    raise ValueError(f"{path}: expected a model directory, a config .json file or a .gguf file")


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """The spec as JSON values (spec_from_dict reads it back equal)."""
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict[str, Any]) -> ModelSpec:
    """The ModelSpec that spec_to_dict wrote (its tuples, read back from JSON lists)."""
    d = dict(d)
    d["sliding_windows"] = tuple(d.get("sliding_windows") or ())
    d["unread"] = tuple(d.get("unread") or ())
    if d.get("moe") is not None:
        moe = dict(d["moe"])
        moe["moe_layers"] = tuple(moe.get("moe_layers") or ())
        d["moe"] = MoESpec(**moe)
    return ModelSpec(**d)


def _config_spec(path: str) -> ModelSpec:
    """The spec of a config.json: derived through transformers' config class once, then read
    from the file's cache entry (core.plan.gguf_cache: keyed by the file's path, size and
    modification time, transformers' version and this module's code), so a restart does not
    import transformers to read it. A config that fails is not cached: its error repeats."""
    from core.plan.gguf_cache import cached_json, source_digest

    def build() -> dict[str, Any]:
        return spec_to_dict(spec_from_config(_read_json(path), source=path))

    spec = spec_from_dict(cached_json(path, f"spec-{source_digest('core.plan.model_spec')}",
                                      build))
    return spec if spec.source == path else dataclasses.replace(spec, source=path)


def _gguf_spec(path: str) -> ModelSpec:
    """The spec of a .gguf file, from its header through transformers' config class once; then
    from the file's GGUF cache entry (core.plan.gguf_cache), keyed by the code that derives it, so
    later starts neither parse the header nor import transformers."""
    from core.plan.gguf_cache import cached_json, package_versions, source_digest

    def build() -> dict[str, Any]:
        from core.plan.gguf_metadata import gguf_to_hf_config, read_gguf_metadata

        return spec_to_dict(spec_from_config(gguf_to_hf_config(read_gguf_metadata(path)),
                                             source=path))

    part = (f"spec-{source_digest('core.plan.model_spec', 'core.plan.gguf_metadata')}-"
            f"{package_versions('gguf')}")
    spec = spec_from_dict(cached_json(path, part, build))
    # one file reached by another path: an entry is keyed by the real path
    return spec if spec.source == path else dataclasses.replace(spec, source=path)
