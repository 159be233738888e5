"""The quant-method protocol, the checkpoint's quantization scheme as data, and loading helpers.

A quant method (a `quant` plugin; registered with `register(name, QuantCaps, factory)`) owns the
weights of every `Linear` the model builds, and of MoE experts where its caps say `moe=True`.
`factory(scheme: QuantScheme)` returns one method object for the whole model:

    create_weights(layer, input_size, output_size, bias, dtype, device)
        Register the layer's parameters (e.g. `weight` fp8 [out, in] + `weight_scale_inv`
        [out/128, in/128]). Each quantized parameter is marked with `mark(param, ...)`, which
        says how a checkpoint tensor of one stacked shard (q/k/v, gate/up) lands in it.
        Parameter names are the checkpoint's own (`weight_scale`, `qweight`, `input_scale`...),
        so the loader can copy them by name.
    process_weights_after_loading(layer)
        Once every tensor is in: repack, transpose, requantize fused shards to one scale,
        quantize a dense weight (online methods). May replace parameters.
    apply(layer, x) -> y
        x [..., in] in the compute dtype -> [..., out] in the compute dtype, bias added.
    bind(layer) -> callable                      (optional) `apply` with the layer's tensors bound.
    init_dummy_weights(layer, seed, std)         (optional) --load-format dummy: fill packed
                                                 integer tensors so the real weights are ~std.
    weight_loader(layer, param, loaded, shard)   (optional) take each checkpoint tensor itself
                                                 instead of the mark()/load_shard copy.
    takes_raw_gguf = True                        (optional) a GGUF file's quantized tensors
                                                 reach weight_loader / load_table as their
                                                 blocks (core.engine.gguf_weights.GGUFBlocks).
    load_summary() -> str                        (optional) a load note: what it kept, how.
    load_table(module, loaded) -> table | None   (optional) the token embedding's / LM head's
                                                 weight kept in the method's own form: a
                                                 table with rows(ids, dtype) and logits(h)
                                                 (fp32); None leaves the tensor dense.
    create_moe_weights(layer, E, H, I, dtype, device) + moe_weights(layer) -> MoEWeights
                                                 (where caps.moe) the experts' stacked tensors
                                                 and the form the MoE runner receives (core.contract.moe).

What a method may assume: `create_weights` runs on the device in the plan; apply's x is
contiguous in the last dim; the layer keeps `input_size`, `output_size`, `output_sizes`.
Dynamic activations, as the conformance suite's references quantize them: scale = amax / qmax
(per token or per group; correctly rounded), codes = round(x * reciprocal(scale)) saturated
(`reciprocal` below: a correctly rounded 1 / scale), so kernels can match codes bit for bit.
What it must not do: read the environment or pick kernels by device type at apply time (choose
once, at process time). Layers a checkpoint leaves dense (`QuantScheme.ignore`: lm_head, routers,
listed modules) are rebuilt dense by `apply_ignore` before loading.
Tensor parallelism (`QuantCaps.tensor_parallel`, checked by the conformance suite's
test_quant_linear_tensor_parallel): a rank's layer is created at its own sizes (`output_size`
of its rows, `input_size` of its inputs) and is handed, per checkpoint tensor, the rank's part
of it (core.layers.linear.tp_narrow: rows of a column-parallel layer, inputs of a row-parallel
one, along dims 0 and 1 of the checkpoint's [out, in]); a method that declares it takes those
parts as a smaller whole weight. Undeclared, the resolver refuses the method at --tp-size > 1.

`parse_quant_config` turns a HF `quantization_config` (fp8, fbgemm_fp8, compressed-tensors, awq,
gptq, gguf) into a `QuantScheme`, which the resolver checks against `QuantCaps` and the chosen
method is built from. `core.layers.linear.DenseLinearMethod` is the dense reference everything
else falls back to (router gates, ignored layers); the `unquantized` plugin serves it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

# the checkpoint's scheme is plan data (pure); re-exported here, the plugins' one import
from core.plan.quant_scheme import (  # noqa: F401
    ACTIVATION_SCHEMES,
    FORMATS,
    ONLINE_FORMATS,
    QuantScheme,
    online_scheme,
    parse_quant_config,
)


class QuantMethod(Protocol):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


def mark(param: nn.Parameter, *, out_dim: int | None = 0, out_per_row: int = 1,
         per_shard: bool = False) -> nn.Parameter:
    """Say how shards land in `param`: along `out_dim`, each row holding `out_per_row` output
    rows (128 for block scales, 8 for int4 packed along the output); `per_shard`: one entry
    per shard ([n_shards] per-tensor scales); out_dim None and not per_shard: one tensor for
    the whole layer (every shard's copy must agree)."""
    param.quant_out_dim = out_dim
    param.quant_out_per_row = out_per_row
    param.quant_per_shard = per_shard
    return param


def load_shard(param: nn.Parameter, loaded: torch.Tensor, rows: slice | None,
               shard_index: int | None) -> None:
    """Copy `loaded` into the part of `param` that output rows `rows` (shard `shard_index`)
    own; rows None: the whole parameter. ValueError when shapes or divisibility disagree."""
    target = param.data
    if rows is not None:
        if getattr(param, "quant_per_shard", False):
            target = target[shard_index]
            loaded = loaded.reshape(target.shape) if loaded.numel() == target.numel() else loaded
        else:
            dim = getattr(param, "quant_out_dim", 0)
            if dim is not None:
                per = getattr(param, "quant_out_per_row", 1)
                if rows.start % per:
                    raise ValueError(f"shard rows start at {rows.start}, not a multiple of "
                                     f"{per} (the tensor's output grain)")
                stop = -(-rows.stop // per)
                target = target.narrow(dim, rows.start // per, stop - rows.start // per)
    if tuple(target.shape) != tuple(loaded.shape):
        if target.numel() == loaded.numel() == 1:
            loaded = loaded.reshape(target.shape)  # scalar scales saved as [] or [1]
        else:
            raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    target.copy_(loaded)


# ---- layers the checkpoint left dense ----

# Our stacked modules -> the checkpoint projections they hold.
STACKED_HF_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                    "gate_up_proj": ("gate_proj", "up_proj")}


def is_ignored(name: str, ignore: Sequence[str]) -> bool:
    """Whether module `name` is left dense by an ignore list (exact names, name suffixes, or
    "re:" patterns as compressed-tensors writes them). A stacked module is ignored when all its
    projections are; some but not all is a ValueError (one tensor cannot mix)."""
    if not ignore:
        return False
    head, _, leaf = name.rpartition(".")
    names = [f"{head}.{p}" if head else p for p in STACKED_HF_NAMES.get(leaf, (leaf,))]
    hits = [_matches(n, ignore) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"{name}: the checkpoint leaves some of its projections dense "
                         f"({', '.join(n for n, h in zip(names, hits, strict=True) if h)}) and quantizes "
                         "the rest; a stacked layer cannot mix")
    return all(hits)


def _matches(name: str, ignore: Sequence[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def apply_ignore(model: nn.Module, scheme: QuantScheme, dense: Any) -> list[str]:
    """Rebuild the linears the scheme leaves dense with the `dense` method (before loading);
    returns their names."""
    rebuilt = []
    for name, module in model.named_modules():
        rebuild = getattr(module, "rebuild_with", None)
        if rebuild is not None and getattr(module, "quant_method", None) is not dense \
                and is_ignored(name, scheme.ignore):
            rebuild(dense)
            rebuilt.append(name)
    return rebuilt


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in fp32, correctly rounded on every device. Activations are quantized as
    x * reciprocal(scale) (then rounded to the 8-bit grid), by the torch paths, the references
    and the Triton kernels alike (these take the reciprocal with tl.math.div_rn, once per scale):
    a product is correctly rounded everywhere, while Triton's fp32 `/` is approximate and an
    exact division per element costs the small-M kernels 2-3x (bench/RESULTS.md)."""
    s = scale.float()
    return torch.ones_like(s) / s


def div_scalar(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d correctly rounded on every device. CUDA's `tensor / python_float` multiplies by the
    reciprocal (1 ulp off for about half the values; CPU divides), and fp8 / int8 codes of bf16
    and fp16 inputs sit on rounding ties often enough that 1 ulp of scale flips ~1e-4 to 1e-3 of
    them: a scale computed this way is the same bit pattern on the CPU and the GPU."""
    return x / torch.full_like(x, d)
