"""A checkpoint's quantization, read from its config alone (`quantization_config`), as data:
the QuantScheme the resolver plans with and a quant method is built for (core.contract.quant is
the method's protocol). Pure: no torch, so plans are made anywhere."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.contract.json_types import JSON

# Weight formats a QuantScheme can name (QuantCaps.formats lists those a method computes).
FORMATS = ("dense", "fp8_block", "fp8_channel", "fp8_tensor", "int8_channel",
           "int4_awq", "int4_gptq", "int4_pack", "gguf")
ACTIVATION_SCHEMES = ("none", "dynamic", "static")  # none: weight-only
# Core's formats a dense checkpoint is quantized into at load (8-bit, per output channel or per
# tensor); a plugin may name its own format instead (QuantCaps.online_format).
ONLINE_FORMATS = ("fp8_channel", "fp8_tensor", "int8_channel")
# What activations can be when the weights are quantized at load: no calibration data, so no
# static scales ("dynamic": per-token scales at run time, W8A8; "none": weight-only).
ONLINE_ACTIVATIONS = ("dynamic", "none")


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization, normalized across the formats that describe it.

    method: the config's quant_method ("none" for a dense checkpoint, even when `online`).
    format: one of FORMATS. weight_bits / group_size (None: per channel, or not grouped) /
    block (fp8_block's [rows, cols]) / zero_point (asymmetric integer weights) describe the
    weights; activations (ACTIVATION_SCHEMES) and act_group (per-token-group size of dynamic
    activation scales, fp8_block) the inputs. online: quantize a dense checkpoint at load.
    ignore: module names / "re:" patterns the checkpoint left dense. kv_scales: the checkpoint
    carries calibrated KV-cache scales. raw: the config as given.
    """

    method: str = "none"
    format: str = "dense"
    weight_bits: int | None = None
    group_size: int | None = None
    block: tuple[int, int] | None = None
    zero_point: bool = False
    activations: str = "none"
    act_group: int | None = None
    online: bool = False
    ignore: tuple[str, ...] = ()
    kv_scales: bool = False
    checkpoint_format: str | None = None  # gptq: "gptq" (zeros stored minus one) or "gptq_v2"
    raw: Mapping[str, JSON] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        if self.format == "dense" or self.format not in FORMATS and not self.online:
            return self.format  # a plugin's own checkpoint format: its fields are in `raw`
        bits = f"w{self.weight_bits}" if self.weight_bits else ""
        acts = {"none": "a16", "dynamic": "a8 dynamic", "static": "a8 static"}[self.activations]
        grain = (f"block {self.block[0]}x{self.block[1]}" if self.block else
                 f"group {self.group_size}" if self.group_size else "")
        parts = [self.format, f"{bits}{acts}", grain, "online" if self.online else ""]
        return ", ".join(p for p in parts if p)


def online_scheme(fmt: str, activations: str = "dynamic", weight_bits: int | None = None
                  ) -> QuantScheme:
    """The scheme of quantizing a dense checkpoint at load into `fmt`: one of core's
    ONLINE_FORMATS (8-bit weights, per output channel or per tensor) or any other format a
    plugin makes (its own name, typically; `weight_bits` as it declares them). `activations`:
    "dynamic" (per-token scales at run time: W8A8, what the built-in methods do) or "none"
    (weight-only). ValueError for what cannot be quantized at load (the message says why);
    QuantCaps.online_scheme() calls this with what a method declares."""
    if not fmt or fmt == "dense":
        raise ValueError(f"no online quantization into {fmt!r}: name the format the weights "
                         "become")
    if activations not in ONLINE_ACTIVATIONS:
        raise ValueError(f"online quantization into {fmt} with {activations!r} activations: "
                         f"{' or '.join(ONLINE_ACTIVATIONS)} (static scales need a calibrated "
                         "checkpoint)")
    bits = 8 if fmt in ONLINE_FORMATS else weight_bits
    return QuantScheme(method="none", format=fmt, weight_bits=bits, activations=activations,
                       online=True)


def parse_quant_config(q: Mapping[str, JSON] | None) -> QuantScheme:
    """The scheme a HF `quantization_config` describes; ValueError for what no format here
    can hold (the message names the field)."""
    if not q:
        return QuantScheme()
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(q)
    if method == "fbgemm_fp8":
        return QuantScheme(method=method, format="fp8_channel", weight_bits=8,
                           activations="dynamic", ignore=_names(q.get("modules_to_not_convert")),
                           raw=q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method in ("awq", "gptq"):
        return _int4(method, q)
    if method == "gguf":
        return QuantScheme(method="gguf", format="gguf", raw=q)
    if method == "w8a8_int8":  # SGLang's own int8 checkpoints
        return QuantScheme(method=method, format="int8_channel", weight_bits=8,
                           activations="dynamic", ignore=_names(q.get("ignore")), raw=q)
    if not method:
        raise ValueError("quantization_config has no quant_method")
    # A method core does not parse (mxfp4, a vendor's): its plugin reads `raw` itself.
    return QuantScheme(method=method, format=method, raw=q)


def _names(value: Iterable[object] | None) -> tuple[str, ...]:
    return tuple(str(v) for v in value or ())


# the helpers below read the config's nested values as they find them, checking each
def _fp8(q: Mapping[str, Any]) -> QuantScheme:
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"quantization_config: fp8 fmt {fmt!r} not supported (e4m3 only)")
    acts = str(q.get("activation_scheme", "dynamic")).lower()
    if acts not in ("dynamic", "static"):
        raise ValueError(f"quantization_config: activation_scheme {acts!r} (dynamic or static)")
    ignore = _names(q.get("modules_to_not_convert")) + _names(q.get("ignored_layers"))
    block = q.get("weight_block_size")
    if block:
        if len(block) != 2 or acts != "dynamic":
            raise ValueError("quantization_config: weight_block_size needs two sizes and "
                             "dynamic activations")
        return QuantScheme(method="fp8", format="fp8_block", weight_bits=8,
                           block=(int(block[0]), int(block[1])), activations="dynamic",
                           act_group=int(block[1]), ignore=ignore, raw=q)
    return QuantScheme(method="fp8", format="fp8_tensor", weight_bits=8, activations=acts,
                       ignore=ignore, raw=q)


def _int4(method: str, q: Mapping[str, Any]) -> QuantScheme:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if bits != 4:
        raise ValueError(f"quantization_config: {method} with {bits} bits (4 only)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: awq version {version!r} (gemm only)")
        return QuantScheme(method="awq", format="int4_awq", weight_bits=4, group_size=group,
                           zero_point=bool(q.get("zero_point", True)),
                           ignore=_names(q.get("modules_to_not_convert")), raw=q)
    if q.get("desc_act"):
        raise ValueError("quantization_config: gptq desc_act (act-order) is not supported")
    return QuantScheme(method="gptq", format="int4_gptq", weight_bits=4,
                       group_size=None if group == -1 else group,
                       zero_point=not bool(q.get("sym", True)),
                       checkpoint_format=str(q.get("checkpoint_format", "gptq")),
                       ignore=_names(q.get("modules_to_not_convert")), raw=q)


def _compressed_tensors(q: Mapping[str, Any]) -> QuantScheme:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config: compressed-tensors with {len(groups)} "
                         "config_groups (one supported)")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    fmt = str(q.get("format", ""))
    bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int"))
    strategy = str(w.get("strategy", "tensor"))
    acts = "none" if not a else ("dynamic" if a.get("dynamic") else "static")
    kv = q.get("kv_cache_scheme") is not None
    common = dict(method="compressed-tensors", weight_bits=bits, activations=acts,
                  ignore=_names(q.get("ignore")), kv_scales=kv, raw=q)
    if a and (int(a.get("num_bits", 8)) != 8 or str(a.get("type", kind)) != kind):
        raise ValueError("quantization_config: compressed-tensors activations must be 8-bit "
                         "of the weights' type")
    if a and not a.get("symmetric", True):
        raise ValueError("quantization_config: asymmetric activations are not supported")
    if acts == "static" and str(a.get("strategy")) != "tensor":
        raise ValueError("quantization_config: static activation scales must be per tensor")
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if strategy == "block":
            shape = w.get("block_structure") or [128, 128]
            return QuantScheme(format="fp8_block", block=(int(shape[0]), int(shape[1])),
                               act_group=int(a.get("group_size") or shape[1]) if a else None,
                               **common)
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"quantization_config: fp8 weight strategy {strategy!r}")
        return QuantScheme(format=f"fp8_{strategy}", **common)
    if fmt == "int-quantized" and kind == "int" and bits == 8:
        if strategy != "channel" or not w.get("symmetric", True):
            raise ValueError("quantization_config: int8 weights must be symmetric per channel")
        return QuantScheme(format="int8_channel", **common)
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and not a:
        size = w.get("group_size")
        return QuantScheme(format="int4_pack", group_size=int(size) if size else None,
                           zero_point=not w.get("symmetric", True), **common)
    raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} with "
                     f"{bits}-bit {kind} weights is not supported")


# ---- loading: how a checkpoint tensor of one stacked shard lands in a parameter ----
