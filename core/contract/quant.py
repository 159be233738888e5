"""The quant-method protocol (`QuantMethod`, a base class), the checkpoint's quantization scheme
as data, and loading helpers.

A quant method (a `quant` plugin; registered with `register(name, QuantCaps, factory)`) owns the
weights of every `Linear` the model builds, of MoE experts where its caps say `moe=True`, and
may keep the token embedding / LM head in its own form. `factory(scheme: QuantScheme)` returns
one `QuantMethod` subclass instance for the whole model (anything else is refused at load).
`create_weights` and `apply` are required; every other member has a default that is what a
method without that need does, so core calls each member as it is, never probing for it:

    create_weights / apply                 required: register a layer's parameters; y = x W^T + b
    process_weights_after_loading          nothing    (repack, requantize, quantize online)
    weight_loader                          the mark() / load_shard copy of each tensor
    bind                                   partial(apply, layer)
    init_dummy_weights                     nothing    (the loader's generic fill stands)
    repack                                 nothing    (a Platform's dense layout does not apply)
    dense_weight                           None       (the weight cannot be given back dense)
    takes_raw_gguf                         False      (GGUF blocks are dequantized first)
    load_table                             None       (the embedding / LM head stays dense)
    load_summary                           None       (no load note)
    create_moe_weights                     ValueError (caps.moe False: no MoE experts)
    process_moe_weights_after_loading      nothing
    moe_weights                            None       (the dense form, MoEWeights(w13, w2))

What a method may assume: `create_weights` runs on the device in the plan; apply's x is
contiguous in the last dim; the layer keeps `input_size`, `output_size`, `output_sizes`.
Dynamic activations, as the conformance suite's references quantize them: scale = amax / qmax
(per token or per group; correctly rounded), codes = round(x * reciprocal(scale)) saturated
(`reciprocal` below: a correctly rounded 1 / scale), so kernels can match codes bit for bit.
What it must not do: read the environment or pick kernels by device type at apply time (choose
once, at process time). Layers a checkpoint leaves dense (`QuantScheme.ignore`: lm_head, routers,
listed modules) are rebuilt dense by `apply_ignore` before loading.

Biases need no marking: `layer.bias` (named so; [out] in the compute dtype, or None) is an
unmarked parameter, and an unmarked parameter lands by output rows (out_dim 0, one element per
row), which is what a bias is, stacked shards included. Under row parallelism rank 0 alone is
handed it (the others zeros), so `apply` adds `layer.bias` as it is, on every rank.

Online quantization (`QuantCaps.online_format`): with `--quantization NAME` a dense checkpoint
is quantized at load into that format; the scheme says `online=True`, the weight arrives dense
in the compute dtype (create_weights registers it so) and `process_weights_after_loading`
quantizes it. `QuantCaps.online_activations` says what happens to activations: "dynamic"
(W8A8: scales per token at run time; the built-in fp8 and w8a8_int8) or "none" (weight-only:
x stays in the compute dtype). The format may be one of core's (`fp8_channel`, `int8_channel`,
...) or the method's own name; `QuantCaps.online_scheme()` is the scheme the method is built with.

Tensor parallelism (`QuantCaps.tensor_parallel`, checked by the conformance suite's
test_quant_linear_tensor_parallel): a rank's layer is created at its own sizes (`output_size`
of its rows, `input_size` of its inputs) and is handed, per checkpoint tensor, the rank's part
of it (core.layers.linear.tp_narrow: rows of a column-parallel layer, inputs of a row-parallel
one, along dims 0 and 1 of the checkpoint's [out, in]); a method that declares it takes those
parts as a smaller whole weight. A row-parallel rank sees only its slice of x, so dynamic
activation scales are the slice's own (a per-token amax over the rank's inputs, not the whole
row's) and an online method quantizes its slice of W alone: the ranks' partial sums are not the
one-rank layer's output, and the suite's reference is the sum of each rank's own reference.
Undeclared, the resolver refuses the method at --tp-size > 1.

`parse_quant_config` turns a HF `quantization_config` (fp8, fbgemm_fp8, compressed-tensors, awq,
gptq, gguf) into a `QuantScheme`, which the resolver checks against `QuantCaps` and the chosen
method is built from. `core.layers.linear.DenseLinearMethod` is the dense reference everything
else falls back to (router gates, ignored layers); the `unquantized` plugin serves it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

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

if TYPE_CHECKING:
    from core.contract.moe import MoEWeights  # core.contract.moe imports this module

# A platform's dense product over its own weight layout, called as matmul(x, weight=W, bias=b)
# with x [..., in] and the packed W -> [..., out] in x's dtype
Matmul = Callable[..., torch.Tensor]
# weight [out, in] -> the packed form `Matmul` takes, or None where it does not apply
Packer = Callable[[torch.Tensor], "torch.Tensor | None"]


class QuantTable(Protocol):
    """A token embedding's / LM head's weight in a quant method's own form (load_table)."""

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The embedding rows of token ids [T] -> [T, hidden] in `dtype`."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, rows] in fp32 (the LM head)."""


class QuantMethod(ABC):
    """One quantization method's linear (and MoE-expert) weights: created, loaded, finished,
    applied. Subclass it; override `create_weights` and `apply`, and whatever else the method
    needs (each default below is what a method without that need does)."""

    # A GGUF file's quantized tensors reach weight_loader / load_table as their blocks
    # (core.engine.gguf_weights.GGUFBlocks) instead of dequantized to a float tensor.
    takes_raw_gguf: bool = False

    def __init__(self, scheme: QuantScheme | None = None):
        """`scheme`: what the checkpoint's weights are, or become when quantized at load
        (scheme.online); the factory is called with it once per model."""
        self.scheme = scheme if scheme is not None else QuantScheme()

    # ---- a linear layer's weights ----

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's parameters (e.g. `weight` fp8 [out, in] + `weight_scale_inv`
        [out/128, in/128]) under the checkpoint's own names (`weight_scale`, `qweight`,
        `input_scale`...), so the loader copies them by name. Each quantized parameter is
        marked with `mark(param, ...)`, which says how a checkpoint tensor of one stacked shard
        (q/k/v, gate/up) lands in it; `layer.bias` needs no mark (the module doc)."""

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: object,
                      shard: str | None) -> None:
        """Take one checkpoint tensor (already cut to this rank's part) into `param`: the whole
        of it (shard None, or a 0-d parameter), or the part shard `shard` owns as `mark` said.
        Override to take tensors in another form (GGUF blocks, with `takes_raw_gguf`)."""
        if shard is None or param.dim() == 0:
            load_shard(param, loaded, None, None)
        else:
            rows = layer.shard_slice(shard)  # KeyError for an unknown shard
            load_shard(param, loaded, rows, layer.shard_names.index(shard))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every tensor is in: repack, transpose, requantize fused shards to one scale,
        quantize a dense weight (online methods). May replace parameters. Default: nothing."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] in the compute dtype -> [..., out] in the compute dtype, bias added."""

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`apply` with the layer's tensors bound (the decode hot path skips module lookups);
        called again after anything replaces them. Default: partial(apply, layer)."""
        return partial(self.apply, layer)

    def init_dummy_weights(self, layer: nn.Module, seed: int, std: float) -> None:
        """--load-format dummy, after the loader's own fill (normal(0, std) floats, scales at
        1): fill packed integer tensors so the real weights are ~std. Default: nothing."""
        return None

    def repack(self, layer: nn.Module, pack: Packer, matmul: Matmul) -> None:
        """After loading, a Platform's dense layout (core.layers.linear.repack_dense_weights):
        replace a dense [out, in] weight by `pack(weight)` (None: not for this weight) and
        compute with `matmul(x, weight=..., bias=...)`. Default: nothing (no dense weight)."""
        return None

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        """After process_weights_after_loading: the layer's weight [out, in] as fp32 values,
        exactly what its tensors mean (e.g. e4m3 codes times their block scales, one
        correctly rounded fp32 product per element), for a layer that must hold it dense (MLA's
        kv_b_proj, split and absorbed by the attention backend). A method that can declares
        QuantCaps.dense_weights. Default: None (it cannot)."""
        return None

    # ---- the token embedding and the LM head ----

    def load_table(self, module: nn.Module, loaded: object) -> QuantTable | None:
        """The embedding's / LM head's weight kept in the method's own form: a table with
        rows(ids, dtype) and logits(h) (fp32), or None to leave the tensor dense (default)."""
        return None

    def load_summary(self) -> str | None:
        """A load note in the method's own words (what it kept, how), once loading is over;
        None (default): no note."""
        return None

    # ---- MoE experts (where QuantCaps.moe) ----

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        """Register the experts' stacked tensors on the MoE layer: `w13_weight` [E, 2I, H]
        (gate rows, then up rows) and `w2_weight` [E, H, I] in the method's dtype, with their
        scales under the checkpoint's per-expert names, marked as for linears. Default: a
        ValueError (a method whose caps say moe=False holds no experts; the resolver refuses
        it for MoE models before this is reached)."""
        raise ValueError(f"{type(self).__name__} does not hold MoE expert weights "
                         "(its QuantCaps.moe is False)")

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """The experts' counterpart of process_weights_after_loading. Default: nothing."""
        return None

    def moe_weights(self, layer: nn.Module) -> MoEWeights | None:
        """The experts in the form the MoE runner receives (core.contract.moe.MoEWeights: its
        `form` names it), built once after loading; None (default): the dense form,
        MoEWeights(layer.w13_weight, layer.w2_weight)."""
        return None


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


def apply_ignore(model: nn.Module, scheme: QuantScheme, dense: QuantMethod) -> list[str]:
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
