"""The support matrix (`core matrix`): what every registered plugin declares, as one table per
plugin kind, and what the resolver chooses for representative models on every device profile.

Nothing here is a second copy of a rule. The tables are the capability dataclasses
(core.contract.capabilities) rendered field by field, so a declaration change moves the table;
the plans are core.plan.resolver.resolve() on core.plan.devices.select_device(profile=...), the
two calls `core resolve --device-profile` makes. Output is deterministic (sorted, no clock, no
probe of this machine), so docs/SUPPORT.md, the built-in plugins' matrix, is committed and a test
(tests/test_matrix.py) fails when it is stale.

Plans are made as if every backend's `requires` packages and `programs` were installed (the
tables list them): which packages this machine lacks is `core resolve`'s business, not the
matrix's. The environment (CORE_DISABLE_FUSED_OPS) is not read either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.contract.capabilities import (
    ATTENTION_KINDS,
    CAPS_TYPES,
    COMPUTE_DTYPES,
    CONSTRAINT_TYPES,
    KV_CACHE_DTYPES,
    PHASES,
    CapabilityRange,
    Caps,
    DeviceInfo,
    PageSizes,
)
from core.contract.hookspecs import PLUGIN_API_VERSION
from core.contract.json_types import JSON
from core.plan.registry import Registration, Registry

if TYPE_CHECKING:
    from core.plan.model_spec import ModelSpec
    from core.plan.plan import Plan, ResolveError

SUPPORT_DOC = "docs/SUPPORT.md"
BUILTIN_DIST = "core-serve"  # pyproject.toml's [project] name
REGENERATE = f"core matrix --plans --only {BUILTIN_DIST} > {SUPPORT_DOC}"

# Representative models of the built-in families, from tests/fixtures/configs (configs of public
# checkpoints, no weights): a family that lands later adds its line here.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("dense", "llama-3.1-8b.json"),
    ("MoE", "qwen3-30b-a3b.json"),
    ("Gemma 2 (soft-caps, windows)", "gemma-2-9b.json"),
    ("MLA", "deepseek-v2-lite.json"),  # DeepSeek-V2 / V3: MLA attention, DeepSeek MoE
    # GPT-OSS with bf16 experts (the published MXFP4 ones need the mxfp4 quant method)
    ("GPT-OSS (sinks, windows, biased swigluoai experts)", "gpt-oss-20b-bf16.json"),
)
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"

# One checkpoint `quantization_config` per weight format core parses (core.plan.quant_scheme
# FORMATS but dense), written as the public checkpoints of that format write it; a test checks
# each parses to its format and that every format has one. A plugin's own checkpoint format (a
# quant_method core does not parse) is added from its QuantCaps.config_names.
CHECKPOINTS: tuple[Mapping[str, JSON], ...] = (
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]},  # fp8_block (Qwen3-*-FP8, DeepSeek-V3)
    {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},  # fp8_channel (Llama 3.1 FP8)
    {"quant_method": "fp8", "activation_scheme": "static"},  # fp8_tensor (AutoFP8)
    {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
     "config_groups": {"group_0": {
         "targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
         "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                               "dynamic": True, "strategy": "token"}}}},  # int8_channel (W8A8)
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
     "version": "gemm"},  # int4_awq
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
     "sym": True},  # int4_gptq
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
     "config_groups": {"group_0": {
         "targets": ["Linear"],
         "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                     "group_size": 128}}}},  # int4_pack (W4A16)
    {"quant_method": "gguf"},  # gguf (what core.plan.gguf_metadata writes for a .gguf file)
)


# ----------------------------------------------------------------------------- JSON values

def jsonable(value: object) -> JSON:
    """A capability value as JSON: dataclasses as objects of every field, sets sorted (numbers
    by value), tuples as lists, maps with string keys; anything else its str()."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=_set_order)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _set_order(v: JSON) -> tuple[int, float, str]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "")
    return (1, 0, json.dumps(v, sort_keys=True))


# ------------------------------------------------------------------------ the registry seen

def only(registry: Registry, dist: str) -> Registry:
    """The registry with only distribution `dist`'s plugins (and their load failures)."""
    entries = {kind: {n: r for n, r in regs.items() if r.origin.dist == dist}
               for kind, regs in registry.entries.items()}
    return Registry(entries=entries,
                    failures=[f for f in registry.failures if f.origin.dist == dist],
                    plugins=[o for o in registry.plugins if o.dist == dist])


def distributions(registry: Registry) -> list[str]:
    """Every distribution that registered a plugin or failed to load one."""
    return sorted({o.dist for o in registry.plugins} | {f.origin.dist for f in registry.failures})


def assume_installed(registry: Registry) -> Registry:
    """The registry with every declaration's `requires` and `programs` emptied: the plans of a
    machine where each backend's packages and programs are there, whatever this one has."""
    def bare(reg: Registration) -> Registration:
        drop = {n: () for n in ("requires", "programs") if hasattr(reg.caps, n)}
        return dataclasses.replace(reg, caps=dataclasses.replace(reg.caps, **drop))

    return Registry(entries={kind: {n: bare(r) for n, r in regs.items()}
                             for kind, regs in registry.entries.items()},
                    failures=list(registry.failures), plugins=list(registry.plugins))


# ------------------------------------------------------------------------ capability tables

# Sets whose every value the contract names read "any" (the declaration accepts them all).
UNIVERSES: dict[str, frozenset[str]] = {
    "dtypes": frozenset(COMPUTE_DTYPES), "kv_cache_dtypes": frozenset(KV_CACHE_DTYPES),
    "attention_kinds": frozenset(ATTENTION_KINDS), "phases": frozenset(PHASES),
    "constraints": frozenset(CONSTRAINT_TYPES),
}
# Fields where the contract reads an empty set, or None, as "no restriction" (see the docs of
# the caps classes); an empty value of any other field is "-".
OPEN_WHEN_EMPTY = frozenset(("formats", "activation_schemes", "group_sizes", "weight_bits",
                             "quant_formats", "head_sizes", "max_experts", "max_top_k"))
# Columns in this order first (where the kind declares them), then its other fields in
# declaration order, then the true flags and the needs; `devices` folds in `capability` and
# `cpu_isa`; the description stays in --json.
LEADING = ("devices", "priority", "dtypes", "kv_cache_dtypes", "head_sizes", "page_sizes",
           "phases", "attention_kinds")
FOLDED = ("capability", "cpu_isa", "requires", "programs", "description")


def _is_flag(f: dataclasses.Field) -> bool:
    return f.type in ("bool", bool)


def columns(kind: str) -> list[str]:
    """The columns of a kind's table after name and distribution: its caps fields."""
    fields = [f for f in dataclasses.fields(CAPS_TYPES[kind]) if not f.name.startswith("_")]
    names = [f.name for f in fields if not _is_flag(f) and f.name not in FOLDED]
    cols = [n for n in LEADING if n in names] + [n for n in names if n not in LEADING]
    if any(_is_flag(f) for f in fields):
        cols.append("flags")
    if any(f.name in ("requires", "programs") for f in fields):
        cols.append("needs")
    return cols


def _sm(n: int) -> str:
    return f"sm{n}"


def _capability(rng: CapabilityRange) -> str:
    parts = []
    if rng.min is not None and rng.max is not None:
        parts.append(_sm(rng.min) if rng.min == rng.max else f"{_sm(rng.min)}-{_sm(rng.max)}")
    elif rng.min is not None:
        parts.append(f"{_sm(rng.min)}+")
    elif rng.max is not None:
        parts.append(f"up to {_sm(rng.max)}")
    if rng.archs is not None:
        parts.append("/".join(sorted(rng.archs)))
    return " ".join(parts)


def _devices(caps: Caps) -> str:
    """Targets, each with its compute-capability range and (the CPU) the ISA it needs."""
    targets = sorted(caps.devices, key=lambda d: (d != "*", d))
    cells = []
    isa_at = "cpu" if "cpu" in targets else ("*" if "*" in targets else None)
    for target in targets:
        cell = "any" if target == "*" else target
        rng = caps.capability.get(target)
        extra = [_capability(rng)] if rng is not None else []
        if target == isa_at and caps.cpu_isa:
            extra.append(("cpu " if target == "*" else "") + "+".join(sorted(caps.cpu_isa)))
        cells.append(f"{cell} ({', '.join(extra)})" if extra else cell)
    return ", ".join(cells) or "-"


def _items(values: Iterable[object]) -> list[str]:
    vals = list(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        return [str(v) for v in sorted(vals)]  # type: ignore[type-var]
    return sorted(str(v) for v in vals)


def _value(name: str, value: object) -> str:
    """One caps field as a cell: "any" where the declaration accepts anything."""
    if value is None:
        return "any" if name in OPEN_WHEN_EMPTY else "-"
    if isinstance(value, PageSizes):
        return value.describe()
    if isinstance(value, (set, frozenset)):
        if not value:
            return "any" if name in OPEN_WHEN_EMPTY else "-"
        if name in UNIVERSES and value == UNIVERSES[name]:
            return "any"
        if name == "constraints":  # the contract's order
            return ", ".join(c for c in CONSTRAINT_TYPES if c in value)
        return ", ".join(_items(value))
    if isinstance(value, Mapping):
        if not value:
            return "-"
        return ", ".join(f"{k}: {v if isinstance(v, int) else _value(name, v)}"
                         for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    return str(value) if value != "" else "-"


def cells(kind: str, caps: Caps) -> list[str]:
    """The cells of one registration's row, in columns(kind) order."""
    out = []
    for col in columns(kind):
        if col == "devices":
            out.append(_devices(caps))
        elif col == "flags":
            flags = [f.name for f in dataclasses.fields(caps)
                     if _is_flag(f) and getattr(caps, f.name)]
            out.append(", ".join(flags) or "-")
        elif col == "needs":
            needs = [*getattr(caps, "requires", ()),
                     *(f"{p} (program)" for p in getattr(caps, "programs", ()))]
            out.append(", ".join(needs) or "-")
        else:
            out.append(_value(col, getattr(caps, col)))
    return out


_RISKY = re.compile(r"[<>`*\[\]&\\]")


def _cell(text: str) -> str:
    """A markdown table cell: pipes escaped, markup-like text in a code span."""
    text = " ".join(str(text).split())
    if _RISKY.search(text):
        tick = "``" if "`" in text else "`"
        text = f"{tick} {text} {tick}" if tick == "``" else f"`{text}`"
    return text.replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def kind_table(registry: Registry, kind: str, with_origin: bool = True) -> list[str]:
    regs = sorted(registry.kind(kind).items())
    if not regs:
        return ["(none registered)"]
    header = ["name", *(["distribution"] if with_origin else []), *columns(kind)]
    return table(header, ([name, *([reg.origin.describe()] if with_origin else []),
                           *cells(kind, reg.caps)] for name, reg in regs))


def failures_table(registry: Registry, with_origin: bool = True) -> list[str]:
    header = ["plugin", *(["distribution"] if with_origin else []), "stage", "error"]
    return table(header, ([f.origin.plugin,
                           *([f"{f.origin.dist} {f.origin.version}".strip()]
                             if with_origin else []), f.stage, f.error]
                          for f in registry.failures))


def matrix_json(registry: Registry, kinds: Sequence[str]) -> dict[str, JSON]:
    """The tables as data: every registration's caps as JSON, and the load failures."""
    return {
        "api_version": PLUGIN_API_VERSION,
        "kinds": {kind: [{"name": name, "plugin": reg.origin.plugin,
                          "distribution": reg.origin.dist, "version": reg.origin.version,
                          "caps": jsonable(reg.caps)}
                         for name, reg in sorted(registry.kind(kind).items())]
                  for kind in kinds},
        "failures": [{"plugin": f.origin.plugin, "distribution": f.origin.dist,
                      "version": f.origin.version, "stage": f.stage, "error": f.error}
                     for f in registry.failures],
    }


# ------------------------------------------------------------------------------------ plans

@dataclass(frozen=True)
class Weights:
    """One way of serving a model: the checkpoint's quantization_config (None: dense) and the
    flags given to `core resolve`."""

    label: str
    quantization_config: Mapping[str, JSON] | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    def flags(self) -> list[str]:
        out = []
        if self.dtype != "auto":
            out += ["--dtype", self.dtype]
        if self.quantization is not None:
            out += ["--quantization", self.quantization]
        if self.kv_cache_dtype != "auto":
            out += ["--kv-cache-dtype", self.kv_cache_dtype]
        return out


def weights_variants(registry: Registry) -> list[Weights]:
    """Each compute dtype and KV-cache dtype of the contract on dense weights, each checkpoint
    format (core's and the registered quant methods' own), and each quant method's
    quantization at load."""
    from core.plan.quant_scheme import FORMATS, parse_quant_config

    out = [Weights("unquantized")]
    out += [Weights(f"unquantized, --dtype {d}", dtype=d) for d in COMPUTE_DTYPES]
    out += [Weights(f"unquantized, --kv-cache-dtype {kv}", kv_cache_dtype=kv)
            for kv in KV_CACHE_DTYPES if kv not in COMPUTE_DTYPES]
    checkpoints = sorted(CHECKPOINTS,
                         key=lambda q: FORMATS.index(parse_quant_config(q).format))
    known = {str(q["quant_method"]) for q in checkpoints}
    for caps in (r.caps for _, r in sorted(registry.kind("quant").items())):
        for name in sorted(caps.config_names - known - {"none"}):
            try:
                scheme = parse_quant_config({"quant_method": name})
            except ValueError:  # a method core parses, which needs more than its name
                continue
            if scheme.format not in FORMATS:  # a plugin's own format
                checkpoints.append({"quant_method": name})
                known.add(name)
    for q in checkpoints:
        fmt = parse_quant_config(q).format
        out.append(Weights(f"{fmt} checkpoint (quant_method {q['quant_method']})", q))
    for name, reg in sorted(registry.kind("quant").items()):
        if reg.caps.online_format:
            out.append(Weights(f"unquantized, --quantization {name} ({reg.caps.online_format} "
                               "at load)", quantization=name))
    return out


@dataclass(frozen=True)
class Model:
    family: str  # dense, MoE, ... (a model given by path: its architecture)
    source: str  # the config's file name, or the path given
    spec: ModelSpec
    config: Mapping[str, JSON]  # its config.json


def family_of(spec: ModelSpec) -> str:
    return "MLA" if spec.attention_kind == "MLA" else ("MoE" if spec.is_moe else "dense")


def load_models(paths: Sequence[str] = ()) -> list[Model]:
    """The representative models (FAMILIES), or the models at `paths` (a config.json, or a
    model folder holding one: plans in other weights rewrite its quantization_config).
    ValueError when one cannot be read."""
    from core.plan.model_spec import load_model_spec

    given = [(None, p) for p in paths] or [(fam, str(CONFIGS_DIR / name))
                                            for fam, name in FAMILIES]
    models = []
    for family, path in given:
        config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            if not config_path.endswith(".json"):
                raise ValueError("plans start from a config.json (the file, or a model folder "
                                 "holding one), not a .gguf file")
            spec = load_model_spec(config_path)
            with open(config_path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError, KeyError) as exc:
            hint = "" if paths else (" (the representative configs are in a checkout's "
                                     "tests/fixtures/configs; or pass --model-path)")
            raise ValueError(f"{path}: {exc}{hint}") from exc
        source = os.path.basename(path) if family is not None else path
        models.append(Model(family or family_of(spec), source, spec, config))
    return models


def _spec_for(model: Model, weights: Weights) -> ModelSpec:
    """The model's spec as a checkpoint in these weights would give it: its config.json with
    the quantization_config replaced, read the way `core resolve` reads one."""
    if weights.quantization_config is None and model.spec.quant_method == "none":
        return model.spec
    from core.plan.model_spec import spec_from_config

    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    if weights.quantization_config is not None:
        config["quantization_config"] = dict(weights.quantization_config)
    return spec_from_config(config, source=model.spec.source)


@dataclass(frozen=True)
class PlanRow:
    model: Model
    weights: Weights
    profile: str
    plan: Plan | None
    error: ResolveError | None


def plan_rows(registry: Registry, models: Sequence[Model], profiles: Sequence[str],
              variants: Sequence[Weights] | None = None) -> list[PlanRow]:
    """resolve() for each model in each weights variant on each profile: the calls `core
    resolve --model-path M --device-profile P <flags>` makes, on `registry` as given (pass it
    through assume_installed for plans that do not depend on this machine)."""
    from core.plan.args import ServerArgs, validate
    from core.plan.devices import select_device
    from core.plan.plan import ResolveError
    from core.plan.resolver import resolve

    rows = []
    for model in models:
        for weights in variants if variants is not None else weights_variants(registry):
            spec = _spec_for(model, weights)
            for profile in profiles:
                # ServerArgs as the flags give them; the environment is not read (it is this
                # machine's, and the matrix describes none in particular)
                args = ServerArgs(dtype=weights.dtype, quantization=weights.quantization,
                                  kv_cache_dtype=weights.kv_cache_dtype, device_profile=profile)
                validate(args)
                device = select_device(registry, profile=profile)
                try:
                    plan, error = resolve(spec, device, args, registry), None
                except ResolveError as exc:
                    plan, error = None, exc
                rows.append(PlanRow(model, weights, profile, plan, error))
    return rows


def first_reason(err: ResolveError) -> str:
    """The refusal in one line: the first failing slot's message and its first reason."""
    first = getattr(err, "errors", [err])[0]
    reason = first.reasons[0] if first.reasons else ""
    return f"{first.args[0]}: {reason}" if reason else first.args[0]


PLAN_FIELDS = ("dtype", "quant_method", "quant_format", "prefill_attention", "decode_attention",
               "moe_runner", "layer_ops", "kv_cache_dtype", "page_size", "cuda_graph",
               "model_impl", "grammar_backend")


def plans_json(rows: Sequence[PlanRow], profiles: Sequence[str]) -> dict[str, JSON]:
    from core.plan.devices import load_profile, profile_to_json

    return {
        "assumes": "every backend's requires packages and programs are installed",
        "profiles": {p: jsonable(profile_to_json(load_profile(p))) for p in profiles},
        "rows": [{
            "family": r.model.family, "model": r.model.source,
            "architecture": r.model.spec.architecture, "weights": r.weights.label,
            "flags": r.weights.flags(),
            "quantization_config": jsonable(r.weights.quantization_config),
            "device_profile": r.profile,
            "plan": None if r.plan is None else {f: getattr(r.plan, f) for f in PLAN_FIELDS},
            "refused": None if r.error is None else {
                "error": r.error.args[0], "reasons": list(r.error.reasons),
                "would_fit": list(r.error.would_fit), "first_reason": first_reason(r.error)},
        } for r in rows],
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.0f} GiB" if n else "-"


def profiles_table(profiles: Sequence[str]) -> list[str]:
    from core.plan.devices import load_profile

    def row(name: str, d: DeviceInfo) -> list[str]:
        cap = f"sm{d.capability}" if d.capability is not None else "-"
        return [name, d.target, d.name, d.arch or "-", cap, _gib(d.memory_bytes),
                ", ".join(sorted(d.features)) or "-"]

    return table(["profile", "target", "device", "arch", "capability", "memory", "features"],
                 (row(p, load_profile(p)) for p in profiles))


def _plan_cells(plan: Plan, moe: bool) -> list[str]:
    quant = plan.quant_method + ("" if plan.quant_format == "dense"
                                 else f" ({plan.quant_format})")
    attention = plan.prefill_attention if plan.prefill_attention == plan.decode_attention \
        else f"{plan.prefill_attention} / {plan.decode_attention}"
    return [plan.dtype, quant, attention, *([plan.moe_runner or "-"] if moe else []),
            plan.layer_ops, plan.kv_cache_dtype, str(plan.page_size),
            "on" if plan.cuda_graph else "off", ""]


def plans_markdown(rows: Sequence[PlanRow], profiles: Sequence[str]) -> list[str]:
    lines = ["## Plans", "",
             "What the resolver chooses (`core resolve --model-path M --device-profile P "
             "[flags]`) for a representative model of each family, in each compute dtype, "
             "KV-cache dtype and weight format, on each simulated device profile; a refusal "
             "gives the first failing slot and its first reason. Plans assume every backend's "
             "packages and programs (`needs` above) are installed; on a machine, `core "
             "resolve` says what is missing there.", "",
             "### Device profiles", "", *profiles_table(profiles)]
    models: dict[str, list[PlanRow]] = {}
    for r in rows:
        models.setdefault(r.model.source, []).append(r)
    for group in models.values():
        model = group[0].model
        impls = sorted({r.plan.model_impl or "none" for r in group if r.plan is not None})
        served = f", model implementation {', '.join(impls)}" if impls else ""
        lines += ["", f"### {model.family}: {model.spec.architecture} ({model.source}"
                      f"{served})"]
        moe = model.spec.is_moe
        header = ["device", "dtype", "quant method", "attention (prefill / decode)",
                  *(["MoE runner"] if moe else []), "layer ops", "KV cache", "page size",
                  "graphs", "refused"]
        variants: dict[str, list[PlanRow]] = {}
        for r in group:
            variants.setdefault(r.weights.label, []).append(r)
        for label, vrows in variants.items():
            body = [[r.profile, *(_plan_cells(r.plan, moe) if r.plan is not None else
                                  ["-"] * (len(header) - 2) + [first_reason(r.error)])]
                    for r in vrows]
            lines += ["", f"#### {model.family}: {label}", "", *table(header, body)]
    return lines


# --------------------------------------------------------------------------------- document

def command_line(kind: str | None, plans: bool, dist: str | None,
                 model_paths: Sequence[str] = (), profiles: Sequence[str] = ()) -> str:
    """The `core matrix` command that gives a document (said in its first lines)."""
    parts = ["core matrix"]
    if kind:
        parts.append(f"--kind {kind}")
    if plans:
        parts.append("--plans")
    if dist:
        parts.append(f"--only {dist}")
    parts += [f"--model-path {p}" for p in model_paths]
    parts += [f"--device-profile {p}" for p in profiles]
    return " ".join(parts)


def markdown(registry: Registry, kinds: Sequence[str], dist: str | None = None,
             rows: Sequence[PlanRow] | None = None, profiles: Sequence[str] = (),
             command: str = "core matrix") -> str:
    """A table per kind, the load failures, then the plans (if any). With `dist` (the
    registry already filtered to it) the distribution column is left out, and with it the
    version, so the document does not change when the version does."""
    whose = (f"the plugins of {dist}" if dist else
             "the plugins installed here (distribution, version and entry point in each row)")
    lines = ["# Support matrix", "",
             f"Generated by `{command}` from what {whose} declare (core plugin API "
             f"{PLUGIN_API_VERSION}); do not edit by hand. \"any\": the declaration accepts "
             "every value; \"-\": it declares none. The columns are the fields of the "
             "capability dataclasses in core/contract/capabilities.py (`core matrix --json`: "
             "every field, descriptions included)."]
    for kind in kinds:
        lines += ["", f"## {kind}", "", *kind_table(registry, kind, with_origin=dist is None)]
    if registry.failures:
        lines += ["", "## Plugins that failed to load", "",
                  *failures_table(registry, with_origin=dist is None)]
    if rows is not None:
        lines += ["", *plans_markdown(rows, profiles)]
    return "\n".join(lines) + "\n"


def document(registry: Registry, *, kind: str | None = None, plans: bool = False,
             dist: str | None = None, model_paths: Sequence[str] = (),
             profiles: Sequence[str] = (), as_json: bool = False) -> str:
    """What `core matrix` prints for these flags. ValueError for a distribution with no
    plugin, a profile or a model that cannot be read."""
    from core.contract.capabilities import KINDS

    if dist is not None:
        if dist not in distributions(registry):
            raise ValueError(f"--only {dist}: no plugin of that distribution is installed "
                             f"(distributions: {', '.join(distributions(registry)) or 'none'})")
        registry = only(registry, dist)
    kinds = [kind] if kind else list(KINDS)
    rows, names = None, list(profiles)
    if plans:
        from core.plan.devices import PROFILES, load_profile

        names = names or list(PROFILES)
        for name in names:
            load_profile(name)  # a bad name or file: its ValueError, before any plan
        rows = plan_rows(assume_installed(registry), load_models(model_paths), names)
    if as_json:
        data = matrix_json(registry, kinds)
        data["only"] = dist
        if rows is not None:
            data["plans"] = plans_json(rows, names)
        return json.dumps(data, indent=2) + "\n"
    return markdown(registry, kinds, dist, rows, names,
                    command_line(kind, plans, dist, model_paths, profiles))


def support_doc(registry: Registry) -> str:
    """docs/SUPPORT.md as REGENERATE writes it: the built-in plugins' matrix and plans."""
    return document(registry, plans=True, dist=BUILTIN_DIST)
