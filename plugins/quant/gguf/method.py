"""The `gguf` quant methods: GGUF's integer formats kept as blocks and multiplied in place.

Each linear keeps its shards (q/k/v, gate/up) as the file gives them until loading ends, then
stacks them into one Packed matrix (formats.py; shards of different types meet in the widest
form, exactly). Products of fewer than `DEQUANT_MIN_ROWS` input rows (decode, short
prefills) run the kernels' integer arithmetic, which computes each row on its own: a decode
step's tokens come out the same whatever they are batched with. From that many rows on
(prefill chunks) the weight is dequantized to the compute dtype for the call and multiplied by
torch (oneDNN): 1.5x the int16 kernel at 512 rows on a 2-core AVX-512 VM, ~10x on a CPU
with AMX (bench/RESULTS.md); its numerics differ from the kernels' at the 1e-5 level
(fp32 sums, no activation rounding), so a long prompt prefilled alone or beside others can
differ in its last bits. The token embedding and the LM head stay in their blocks too
(`load_table`). Tensors the file stores as floats, and any GGML type the
kernels lack, are served dense (F.linear), and the load notes count them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.contract.quant import QuantMethod, QuantScheme, load_shard
from plugins.quant.gguf.formats import SUPPORTED, Packed, from_ggml, stack
from plugins.quant.gguf.kernels import AmxKernels, Kernels

# From this many rows of input on, dequantize + torch's GEMM (prefill) instead of the kernels:
# bench/bench_gguf_kernels.py found the kernels ahead at 16 rows and behind at 512 (both on this
# project's 2-core AVX-512 VM and on an AMX host); 128 lies between, not tuned further.
DEQUANT_MIN_ROWS = 128


def _is_blocks(t: object) -> bool:
    return hasattr(t, "ggml_type") and hasattr(t, "data")


# gguf_amx (bench/bench_gguf_amx.py on a 2-core Xeon with AMX, SmolLM2's and a Llama-3-8B
# shape, one thread): the int8-tile kernel (the VNNI kernel's arithmetic) passes the VNNI
# kernel between 4 and 8 rows and dequantize + fp32 F.linear at every size measured (8-512
# rows). bf16 inputs of AMX_INT_MIN_ROWS rows or more go to it, and from AMX_BF16_MIN_ROWS on
# to the bf16-tile kernel (the weights dequantized to bf16 inside it), whose rate passes the
# int8 tiles' between 64 and 128 rows; matrices the int8 tiles do not take (Q6_K's blocks of
# 16) go to the bf16 tiles from AMX_MIN_ROWS. fp32 inputs keep the VNNI kernel below
# DEQUANT_MIN_ROWS, so that under fp32 a decode step's tokens stay the same whatever they are
# batched with (the int8 tiles sum the same integers in another fp32 order), and take the
# int8 tiles from there on instead of dequantize + F.linear.
AMX_INT_MIN_ROWS = 8
AMX_BF16_MIN_ROWS = 128
AMX_MIN_ROWS = 32


def product(kernels: Kernels, w: Packed, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None,
            amx: AmxKernels | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ W^T (+ bias): the kernels below DEQUANT_MIN_ROWS rows, dequantize + F.linear
    from there on; out_dtype (None: x's) for the LM head's fp32 logits. With `amx`, bf16
    inputs of AMX_INT_MIN_ROWS rows or more and fp32 ones of DEQUANT_MIN_ROWS go to AMX tiles
    instead (above): the int8 tiles compute what the kernels compute, in another order of the
    fp32 sums; each row's result is the same whatever else the batch holds within one
    kernel."""
    fbias = bias.detach().float().contiguous() if bias is not None else None
    small = kernels.bind(w, fbias, out_dtype)
    tiles = amx.bind(w, fbias, out_dtype) if amx is not None else None
    ints = (amx.bind_int(w, fbias, out_dtype) if amx is not None and amx.takes_int(w)
            else None)
    dequantize = kernels.dequantize

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            m = x.shape[0]
            if tiles is not None and x.dtype == torch.bfloat16 and m >= (
                    AMX_BF16_MIN_ROWS if ints is not None else AMX_MIN_ROWS):
                return tiles(x)
            if ints is not None and m >= (AMX_INT_MIN_ROWS if x.dtype == torch.bfloat16
                                          else DEQUANT_MIN_ROWS):
                return ints(x)
            if m >= DEQUANT_MIN_ROWS:
                y = F.linear(x, dequantize(w, x.dtype), bias)
                return y if out_dtype is None else y.to(out_dtype)
        return small(x)

    return run


class GGUFTable:
    """A token embedding / LM head weight kept as blocks: rows for lookups, logits for the
    head."""

    def __init__(self, packed: Packed, kernels: Kernels, amx: AmxKernels | None = None):
        self.packed, self.kernels = packed, kernels
        self.logits = product(kernels, packed, out_dtype=torch.float32, amx=amx)  # -> fp32

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.kernels.dequantize(self.packed, dtype, rows=ids)


class GGUFLinearMethod(QuantMethod):
    """core.contract.quant protocol for GGUF checkpoints (one object per model; one ISA variant)."""

    takes_raw_gguf = True
    variant = "portable"
    act_bits = 16
    amx_tiles = False  # gguf_amx: products of AMX_INT_MIN_ROWS+ rows on AMX tiles

    @classmethod
    def prebuild(cls) -> None:
        """core.plan.prebuild's hook: this variant's kernel libraries compiled into the cache
        (what __init__ below loads)."""
        from plugins._kit.cbuild import prebuild
        from plugins.quant.gguf.kernels import AMX_SOURCE, SOURCE

        prebuild(SOURCE, cls.variant)
        if cls.amx_tiles:
            prebuild(AMX_SOURCE, "amx")

    def __init__(self, scheme: QuantScheme | None = None):
        super().__init__(scheme)
        # builds / loads the library now, not mid-request
        self.kernels = Kernels(self.variant, self.act_bits)
        self.amx = AmxKernels() if self.amx_tiles else None
        self.counts: dict[str, int] = {}  # GGML type -> linears / tables holding it

    # ---- weights ----
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        # A placeholder the loader can name; the matrix itself is layer.packed / layer.dense.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device),
                                    requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype, device=device),
                                   requires_grad=False) if bias else None)
        layer.gguf_parts = {}
        layer.packed = None
        layer.dense = None
        layer.dense_matmul = None  # a platform's product over `dense`, once repacked for it
        layer.compute_dtype = dtype

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: object,
                      shard: str | None) -> None:
        if param is not layer.weight:  # a bias: a float tensor, copied like any other
            rows = layer.shard_slice(shard) if shard is not None else None
            index = layer.shard_names.index(shard) if shard is not None else None
            load_shard(param, loaded, rows, index)
            return
        rows = layer.shard_slice(shard)
        want = (rows.stop - rows.start, layer.input_size)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expected shape {want}, got {tuple(loaded.shape)}")
        if _is_blocks(loaded) and loaded.ggml_type in SUPPORTED:
            part = from_ggml(loaded.ggml_type, loaded.data, layer.input_size)
        elif _is_blocks(loaded):  # a GGML type without a kernel here: served dense
            part = loaded.dequantize()
        else:
            part = loaded.detach().float()
        layer.gguf_parts[shard] = part

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.gguf_parts:
            return  # processed already (or dummy weights filled it)
        names = layer.shard_names or [None]
        missing = [n for n in names if n not in layer.gguf_parts]
        if missing:
            raise ValueError(f"GGUF linear is missing shards {missing}")
        parts = [layer.gguf_parts[n] for n in names]
        layer.gguf_parts = {}
        if all(isinstance(p, Packed) for p in parts):
            layer.packed = stack(parts)
            if self.amx is not None and self.amx.takes_int(layer.packed):
                self.amx.int_tiles(layer.packed)  # at load, not in the first request
            for t in layer.packed.types:
                self.counts[t] = self.counts.get(t, 0) + 1
        else:  # any float shard: the whole layer dense, in the compute dtype
            dense = [p if isinstance(p, torch.Tensor) else self.kernels.dequantize(p,
                                                                                  torch.float32)
                     for p in parts]
            layer.dense = torch.cat(dense).to(layer.compute_dtype)
            self.counts["dense"] = self.counts.get("dense", 0) + 1

    def init_dummy_weights(self, layer: nn.Module, seed: int, std: float) -> None:
        """--load-format dummy: random Q8_0-like blocks whose weights are ~N(0, std)."""
        if getattr(layer, "packed", None) is not None or not hasattr(layer, "gguf_parts"):
            return
        gen = np.random.default_rng(seed & 0xFFFFFFFF)
        n, k = layer.output_size, layer.input_size
        codes = np.clip(np.rint(gen.standard_normal((n, k)) * 32 + 128), 1, 255)
        scales = torch.full((n, k // 32), std / 32, dtype=torch.float16)
        layer.packed = Packed(torch.from_numpy(codes.astype(np.uint8)), scales,
                              scales * -128, 8, 32, ("dummy",))
        layer.gguf_parts = {}
        if layer.bias is not None:
            layer.bias.data.zero_()

    def load_table(self, module: nn.Module, loaded: object) -> GGUFTable | None:
        if not (_is_blocks(loaded) and loaded.ggml_type in SUPPORTED):
            return None
        packed = from_ggml(loaded.ggml_type, loaded.data, int(loaded.shape[-1]))
        self.counts[f"{loaded.ggml_type} table"] = self.counts.get(
            f"{loaded.ggml_type} table", 0) + 1
        return GGUFTable(packed, self.kernels, self.amx)

    # ---- compute ----
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.bind(layer)(x)

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if layer.dense is not None:
            matmul = layer.dense_matmul
            if matmul is not None:
                return lambda x: matmul(x, weight=layer.dense, bias=layer.bias)
            return lambda x: F.linear(x, layer.dense, layer.bias)
        return product(self.kernels, layer.packed, layer.bias, amx=self.amx)

    def repack(self, layer: nn.Module, pack: Callable, matmul: Callable) -> None:
        """A platform's dense layout applies to the layers served dense only."""
        if layer.dense is not None:
            packed = pack(layer.dense)
            if packed is not None:
                layer.dense, layer.dense_matmul = packed, matmul

    def load_summary(self) -> str:
        held = ", ".join(f"{n} {t}" for t, n in sorted(self.counts.items()))
        tiles = (f"; AMX int8 tiles for bf16 products of {AMX_INT_MIN_ROWS}+ rows and fp32 "
                 f"ones of {DEQUANT_MIN_ROWS}+, bf16 tiles for bf16 ones of "
                 f"{AMX_BF16_MIN_ROWS}+" if self.amx is not None else "")
        return (f"GGUF blocks kept ({self.kernels.variant} kernels, int{self.act_bits} "
                f"activations{tiles}): {held or 'nothing yet'}")


def method_class(variant: str, act_bits: int) -> type:
    """The method class of one (ISA variant, activation bits) registration."""
    return type(f"GGUF_{variant}_a{act_bits}", (GGUFLinearMethod,),
                {"variant": variant, "act_bits": act_bits})


GGUFAvx512Method = method_class("avx512_vnni", 16)
GGUFAvx512Q8Method = method_class("avx512_vnni", 8)
GGUFAvx2Method = method_class("avx2", 16)
GGUFAvx2Q8Method = method_class("avx2", 8)
GGUFPortableQ8Method = method_class("portable", 8)
GGUFAmxMethod = type("GGUF_amx_a16", (GGUFLinearMethod,),
                     {"variant": "avx512_vnni", "act_bits": 16, "amx_tiles": True})
