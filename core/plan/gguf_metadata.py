"""GGUF metadata: the key/value header and tensor table of a .gguf file, read without its weights.

The `gguf` package's GGUFReader parses every field, including tokenizer arrays of ~10^5 strings,
which takes seconds; the model spec needs a few dozen scalars, so this reads the header itself
from a memory map (only the header's pages are touched) and skips long string arrays.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from core.contract.json_types import JSONObject

GGUF_MAGIC = b"GGUF"
# a header value: a scalar (integer, float, bool), a string, or an array of one of those
GGUFScalar: TypeAlias = int | float | bool | str
GGUFValue: TypeAlias = int | float | bool | str | list[int | float | bool] | list[str]
# scalar value types: id -> struct format char
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# longer arrays (vocabularies, merges, token scores) keep only their length
_KEEP_STRINGS = 64
_KEEP_NUMBERS = 4096

# GGUF architecture name -> transformers model_type, where the two differ
_ARCH_TO_MODEL_TYPE = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "deepseek2": "deepseek_v2",
    "gpt-oss": "gpt_oss",
    "command-r": "cohere",
    "gemma3": "gemma3_text",
    "minimax-m2": "minimax_m2",
}
# "{arch}.<suffix>" -> HF config key, for keys whose meaning is the same in every architecture
_COMMON_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "leading_dense_block_count": "first_k_dense_replace",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank",
}


@dataclass(frozen=True)
class GGUFMetadata:
    """The header of one GGUF file: its key/values, long-array lengths, and tensor table."""

    path: str
    version: int
    fields: dict[str, GGUFValue]
    array_lengths: dict[str, int] = field(default_factory=dict)  # every array field, long or not
    tensor_types: dict[str, int] = field(default_factory=dict)  # tensor name -> ggml type id
    # tensor name -> (dims innermost-first, ggml type id, byte offset in the file)
    tensor_table: dict[str, tuple[tuple[int, ...], int, int]] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: mmap.mmap, order: str, path: str):
        self.buf, self.pos, self.order, self.path = buf, 0, order, path

    def unpack(self, fmt: str) -> Any:  # int, float or bool as `fmt` says
        fmt = self.order + fmt
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise ValueError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> GGUFScalar:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def _read_array(cur: _Cursor) -> tuple[list[int | float | bool] | list[str] | None, int]:
    """Returns (values or None when skipped, length)."""
    etype, count = cur.unpack("I"), cur.unpack("Q")
    if etype in _SCALARS:
        fmt = cur.order + f"{count}{_SCALARS[etype]}"
        size = struct.calcsize(fmt)
        if count > _KEEP_NUMBERS:
            cur.pos += size
            return None, count
        values = struct.unpack_from(fmt, cur.buf, cur.pos)
        cur.pos += size
        return list(values), count
    if etype == _STRING:
        if count > _KEEP_STRINGS:  # a vocabulary: ~10^5 strings, only stepped over
            unpack, buf, pos = struct.Struct(cur.order + "Q").unpack_from, cur.buf, cur.pos
            end = len(buf)
            for _ in range(count):
                if pos + 8 > end:
                    raise ValueError(f"{cur.path}: GGUF header is truncated at byte {pos}")
                pos += 8 + unpack(buf, pos)[0]
            cur.pos = pos
            return None, count
        return [cur.string() for _ in range(count)], count
    if etype == _ARRAY:  # nested arrays: none in practice; read and drop
        for _ in range(count):
            _read_array(cur)
        return None, count
    raise ValueError(f"{cur.path}: unknown GGUF array element type {etype} at byte {cur.pos}")


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Read the key/value header and tensor table of `path`; tensor data is never touched."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ValueError(f"{path}: not a GGUF file (empty)") from e
    with buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        (version,) = struct.unpack_from("<I", buf, 4)
        order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian host: the version reads byte-swapped
            order, (version,) = ">", struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
        cur = _Cursor(buf, order, path)
        cur.pos = 8
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        fields: dict[str, GGUFValue] = {}
        lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key, vtype = cur.string(), cur.unpack("I")
            if vtype == _ARRAY:
                values, lengths[key] = _read_array(cur)
                if values is not None:
                    fields[key] = values
            else:
                fields[key] = cur.value(vtype)
        tensors: dict[str, int] = {}
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            dims = tuple(cur.unpack("Q") for _ in range(n_dims))
            tensors[name] = cur.unpack("I")
            infos.append((name, dims, tensors[name], cur.unpack("Q")))
        align = int(fields.get("general.alignment", 32) or 32)
        data = -(-cur.pos // align) * align  # tensor data starts at the next aligned byte
    table = {name: (dims, kind, data + off) for name, dims, kind, off in infos}
    return GGUFMetadata(path=path, version=version, fields=fields, array_lengths=lengths,
                        tensor_types=tensors, tensor_table=table)


def _type_name(enum_name: str, value: int) -> str:
    """Name of a ggml enum value from the gguf package, or the number when it is unknown."""
    try:
        import gguf

        return getattr(gguf, enum_name)(value).name
    except (ImportError, ValueError):
        return str(value)


# llama.cpp's Gemma (src/llama-model.cpp): what the file leaves out, llama.cpp fixes in code
GEMMA_ARCHS = ("gemma2", "gemma3")
# layer count of the 27B models, whose softmax scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}  # every n-th layer is global, the others slide
_GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope base of Gemma 3's sliding layers


def gemma_config(meta: GGUFMetadata) -> JSONObject:
    """The HF config fields of a llama.cpp Gemma 2 / Gemma 3 file (general.architecture gemma2 or
    gemma3) as llama.cpp itself runs it: its converter writes the soft-caps and the window but
    neither query_pre_attn_scalar nor the layer pattern nor Gemma 3's local rope, which llama.cpp
    sets in code (27B models by their layer count scale by hidden / heads, the rest by head_dim;
    Gemma 2 alternates windows, Gemma 3 makes every 6th layer global; Gemma 3's sliding layers
    use rope base 10000 unscaled, its global ones the file's base and linear scaling).
    transformers' GGUF config conversion drops these (it takes its config class's defaults: soft-caps
    50 / 30, query_pre_attn_scalar 256, no rope scaling), so they are filled from here.
    ValueError for what llama.cpp's Gemma would not read the same way (a rope scaling other than
    linear)."""
    arch = meta.architecture
    if arch not in GEMMA_ARCHS:
        raise ValueError(f"{meta.path}: {arch!r} is not a Gemma 2 / Gemma 3 GGUF architecture")
    f, prefix = meta.fields, arch + "."
    n_layers = int(f.get(prefix + "block_count", 0) or 0)
    hidden = int(f.get(prefix + "embedding_length", 0) or 0)
    heads = f.get(prefix + "attention.head_count")
    if isinstance(heads, list):  # per-layer head counts: llama.cpp reads layer 0's
        heads = heads[0]
    heads = int(heads or 0)
    head_dim = f.get(prefix + "attention.key_length") or (hidden // heads if heads else None)
    cfg: JSONObject = {}
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    if n_layers == _GEMMA_27B_LAYERS[arch] and heads:
        cfg["query_pre_attn_scalar"] = hidden // heads
    elif head_dim is not None:
        cfg["query_pre_attn_scalar"] = int(head_dim)
    window = f.get(prefix + "attention.sliding_window")
    if arch == "gemma2":
        window = window or 4096  # llama.cpp's default for a file without the key
        cfg["attn_logit_softcapping"] = float(f.get(prefix + "attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(f.get(prefix + "final_logit_softcapping", 30.0))
    else:
        cfg["attn_logit_softcapping"] = None
        final = f.get(prefix + "final_logit_softcapping")
        cfg["final_logit_softcapping"] = float(final) if final else None
    period = _GEMMA_SWA_PERIOD[arch]  # (llama.cpp reads no per-layer pattern key for these)
    sliding = [bool(window) and i % period < period - 1 for i in range(n_layers)]
    cfg["sliding_window"] = int(window) if window else None
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    base = float(f.get(prefix + "rope.freq_base", 10000.0))
    scaling = f.get(prefix + "rope.scaling.type")
    factor = f.get(prefix + "rope.scaling.factor")
    if not scaling and f.get(prefix + "rope.scale_linear"):  # the older key
        scaling, factor = "linear", f[prefix + "rope.scale_linear"]
    if scaling in (None, "", "none") or (scaling == "linear" and float(factor or 1.0) == 1.0):
        rope: JSONObject = {"rope_type": "default", "rope_theta": base}
    elif scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(factor), "rope_theta": base}
    else:
        raise ValueError(f"{meta.path}: {arch} with rope scaling {scaling!r}: llama.cpp's "
                         "Gemma reads only linear scaling, and so does this loader")
    if arch == "gemma2":
        cfg["rope_parameters"] = rope
    else:
        cfg["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
            "full_attention": rope}
    return cfg


def gguf_to_hf_config(meta: GGUFMetadata) -> JSONObject:
    """A HF-style config dict from GGUF metadata (keys named as in config.json).

    `architectures` and `torch_dtype` are left out: a GGUF file names neither (the caller says so).
    """
    arch = meta.architecture
    if not arch:
        raise ValueError(f"{meta.path}: GGUF metadata has no general.architecture")
    f = meta.fields
    prefix = arch + "."
    cfg: JSONObject = {}
    for suffix, hf_key in _COMMON_KEYS.items():
        value = f.get(prefix + suffix)
        if isinstance(value, list):  # per-layer values: only a uniform one maps to a HF scalar
            if len(set(value)) != 1:
                continue
            value = value[0]
        if value is not None:
            cfg[hf_key] = value
    model_type = _ARCH_TO_MODEL_TYPE.get(arch, arch)
    experts = f.get(prefix + "expert_count")
    if experts:
        # llama.cpp writes Mixtral as a "llama" with experts
        if model_type == "llama":
            model_type = "mixtral"
        key = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
               "deepseek_v2": "n_routed_experts"}.get(model_type, "num_local_experts")
        cfg[key] = experts
    cfg["model_type"] = model_type
    rope_dims = f.get(prefix + "rope.dimension_count")
    key_len = f.get(prefix + "attention.key_length_mla", f.get(prefix + "attention.key_length"))
    value_len = f.get(prefix + "attention.value_length_mla",
                      f.get(prefix + "attention.value_length"))
    if "kv_lora_rank" in cfg:
        # MLA: the query/key head is a no-rope part plus a rope part
        cfg.setdefault("q_lora_rank", None)
        if rope_dims is not None:
            cfg["qk_rope_head_dim"] = rope_dims
            if key_len is not None:
                cfg["qk_nope_head_dim"] = key_len - rope_dims
        if value_len is not None:
            cfg["v_head_dim"] = value_len
    elif key_len is not None:
        cfg["head_dim"] = key_len
    swa = f.get(prefix + "attention.sliding_window_pattern")
    if isinstance(swa, list) and swa and all(isinstance(v, bool) for v in swa):
        # per-layer flags, true where the layer uses the sliding window
        cfg["layer_types"] = ["sliding_attention" if v else "full_attention" for v in swa]
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta.array_lengths:
        cfg["vocab_size"] = meta.array_lengths["tokenizer.ggml.tokens"]
    scaling_type = f.get(prefix + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling: JSONObject = {"rope_type": scaling_type}
        if (factor := f.get(prefix + "rope.scaling.factor")) is not None:
            scaling["factor"] = factor
        if (orig := f.get(prefix + "rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = scaling
    # no separate output matrix means the LM head reuses the embedding
    cfg["tie_word_embeddings"] = "output.weight" not in meta.tensor_types
    if arch in GEMMA_ARCHS:
        cfg.pop("rope_theta", None)
        cfg.pop("rope_scaling", None)
        cfg.update(gemma_config(meta))
    quant: JSONObject = {"quant_method": "gguf"}
    if (file_type := f.get("general.file_type")) is not None:
        quant["file_type"] = _type_name("LlamaFileType", file_type)
    counts = Counter(_type_name("GGMLQuantizationType", t) for t in meta.tensor_types.values())
    quant["tensor_types"] = dict(sorted(counts.items()))
    cfg["quantization_config"] = quant
    return cfg
