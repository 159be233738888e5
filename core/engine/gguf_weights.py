"""GGUF weights for the loader (core.engine.loader), under HF parameter names: dequantized tensors, or
(for a quant method that computes GGML's block formats itself, `takes_raw_gguf`) the blocks as
the file holds them (`GGUFBlocks`); float tensors (F32 / F16 / BF16) always come as tensors.

llama.cpp names (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) map to HF's; for
the `llama` GGUF architecture, llama.cpp's converter permuted the rows of Q and K so that its
interleaved rotary matches HF's half-split one, and that permutation is undone here (as
transformers' own GGUF loader does). For `gemma2` / `gemma3` (no permutation: llama.cpp runs them
with the half-split rotary) the converter added 1 to every RMSNorm weight, which comes off here,
and the sandwich norms have names of their own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from typing import TypeVar

    from gguf import GGUFReader, ReaderTensor
    from gguf.constants import GGMLQuantizationType

    from core.engine.loader import HFConfig

    _Rows = TypeVar("_Rows", torch.Tensor, np.ndarray)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 / 3 (sandwich norms): llama.cpp's names for the norms Llama does not have, and its
# ffn_norm is the pre-MLP norm, not Llama's post-attention one
_GEMMA_BLOCK = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GGUF architectures whose converter stored every RMSNorm weight w as 1 + w (llama.cpp's norm is
# a plain x * w; HF's Gemma norm scales by 1 + w): the 1 is taken off again here
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# Tensors that carry nothing our layers use (rope frequencies are recomputed from the config).
_SKIP = ("rope_freqs.weight",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# GGUF architectures whose Q/K rows llama.cpp permuted at conversion
_PERMUTED_ARCHS = ("llama",)


# GGML types that are plain floats: always handed over as tensors
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class GGUFBlocks:
    """One quantized tensor as the file stores it: `data` uint8 [rows, bytes per row] of GGML
    type `ggml_type` (its name: "Q4_1", "Q6_K", ...), `shape` the logical [rows, cols]."""

    def __init__(self, ggml_type: str, data: np.ndarray, shape: tuple[int, ...]):
        self.ggml_type = ggml_type
        self.data = data
        self.shape = tuple(shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols] through the gguf package."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        arr = dequantize(self.data, GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(self.shape))

    def __repr__(self) -> str:
        return f"GGUFBlocks({self.ggml_type}, shape={self.shape})"


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF parameter name of a llama.cpp tensor name in a file of GGUF architecture `arch`
    (unknown names are returned as is)."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        block = _GEMMA_BLOCK if arch in _NORM_PLUS_ONE else _BLOCK
        if part in block:
            return f"model.layers.{layer}.{block[part]}.{kind}"
        return gguf_name
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    return gguf_name


def unpermute_rope_rows(w: _Rows, n_heads: int) -> _Rows:
    """Undo llama.cpp's Q/K row permutation: per head, rows (d/2, 2) interleaved -> (2, d/2).
    A torch tensor or a numpy array of rows (a quantized tensor's rows of blocks: each row is
    whole, so permuting rows of bytes permutes the rows it holds)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(
            w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def field_value(reader: GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    part = field.parts[field.data[0]]
    return bytes(part).decode() if part.dtype == np.uint8 else part.tolist()[0]


class _Tensor:
    """What gguf_weights reads of a GGUFReader tensor: name, shape (innermost first), type,
    data (a view of the file: uint8 [rows, bytes per row] for block types)."""

    def __init__(self, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType,
                 data: np.ndarray):
        self.name, self.shape, self.tensor_type, self.data = name, shape, tensor_type, data


def _tensor_table(path: str) -> tuple[str, list[_Tensor]]:
    """(architecture, tensors) from the header (core.plan.gguf_metadata) and a memory map of the
    file: GGUFReader's parse of every key/value field (the tokenizer's ~10^5 strings) costs
    seconds that the weights do not need."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from core.plan.gguf_metadata import read_gguf_metadata

    meta = read_gguf_metadata(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = []
    for name, (dims, kind, offset) in meta.tensor_table.items():
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        if count % block:
            raise ValueError(f"tensor {name}: {count} elements do not fill {qtype.name} blocks")
        raw = mm[offset:offset + count // block * size]
        shape = tuple(reversed(dims))  # outermost first
        if qtype.name in ("F32", "F16", "F64"):
            data = raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[qtype.name])
            data = data.reshape(shape)
        elif qtype.name == "BF16":
            data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
            qtype = GGMLQuantizationType.F32
        else:
            data = raw.reshape(-1, dims[0] // block * size) if len(dims) > 1 else raw
        out.append(_Tensor(name, dims, qtype, data))
    return str(meta.fields.get("general.architecture", "")), out


def gguf_weights(path: str, config: HFConfig, reader: GGUFReader | None = None,
                 raw: bool = False) -> tuple[int, Iterator[tuple[str, torch.Tensor | GGUFBlocks]]]:
    """(tensor count, iterator of (HF name, fp32 tensor)) for a GGUF file (or its reader);
    raw: quantized tensors come as GGUFBlocks instead."""
    from gguf.quants import dequantize

    arch: object  # the file's architecture field
    tensors: Sequence[_Tensor | ReaderTensor]
    if reader is None:  # the header's tensor table read by core.plan.gguf_metadata: no field parse
        try:
            arch, tensors = _tensor_table(path)
        except Exception as exc:  # a truncated or foreign file
            raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    else:
        arch, tensors = field_value(reader, "general.architecture"), reader.tensors
    permute = arch in _PERMUTED_ARCHS
    norm_minus_one = arch in _NORM_PLUS_ONE
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    tensors = [t for t in tensors if t.name not in _SKIP]

    def it() -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        for t in tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            name = hf_name(t.name, str(arch))
            # a norm is always a tensor (its 1 comes off); llama.cpp keeps norms F32 anyway
            is_norm = norm_minus_one and name.endswith("norm.weight")
            if raw and t.tensor_type.name not in FLOAT_TYPES and not is_norm:
                data = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1) \
                    if len(shape) == 2 else np.asarray(t.data, dtype=np.uint8)
                if permute and name.endswith("self_attn.q_proj.weight"):
                    data = unpermute_rope_rows(data, n_heads)
                elif permute and name.endswith("self_attn.k_proj.weight"):
                    data = unpermute_rope_rows(data, n_kv)
                yield name, GGUFBlocks(t.tensor_type.name, data, shape)
                continue
            try:
                arr = dequantize(t.data, t.tensor_type)
            except NotImplementedError as exc:
                raise ValueError(f"{path}: tensor {t.name} has GGML type "
                                 f"{t.tensor_type.name}, which cannot be dequantized") from exc
            # GGUF lists dims innermost-first; torch wants them outermost-first.
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
            if not arr.flags.writeable:
                arr = arr.copy()
            w = torch.from_numpy(arr)
            if is_norm:
                w = w - 1.0  # exact: the stored 1 + w lies in [0.5, 2] for the usual |w| < 1
            if permute and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                w = unpermute_rope_rows(w, n_heads)
            elif permute and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                w = unpermute_rope_rows(w, n_kv)
            yield name, w

    return len(tensors), it()
