"""`cpu_amx` attention: causal extend (prefill) attention on AMX bf16 tiles (attn_amx.c), for
Xeons with AMX; decode and short extends are cpu_c_avx512's C kernel.

A bf16 extend step whose requests add more than cpu_c's SHORT_EXTEND tokens each writes its K/V
into the pool, then one C call computes every request's causal attention from the pool
(flash attention in blocks of 16 query rows x 32 keys: K and V of each (request, KV head) packed
once into the tiles' layouts, scores and P @ V on the tiles, the online softmax in fp32; see
attn_amx.c). Handles GQA / MQA, sliding windows and logit soft-caps. Falls back to the inherited
paths (torch_native's gather + SDPA) for: fp32 compute, a KV cache that is not bf16, head dims
that are not multiples of 32 (K) / 16 (V), attention sinks (not declared anyway).

Numerics: bf16 x bf16 products summed in fp32 on the tiles, the softmax probabilities rounded
to bf16 before P @ V (the row sums add them as rounded), fp32 accumulation, bf16 output. The
summation order differs from SDPA's.

Costs: a scratch copy of the step's visible K/V per call and layer (keys x KV heads x (D + Dv)
x 2 bytes, 16 MiB for a 4096-token Llama-8B prompt), allocated and freed by the kernel; the
softmax is C the compiler vectorizes (AVX-512 in the `amx` build), not hand-written intrinsics.

`library("emulated")` is the same source with plain-C tile primitives (-DAMX_EMULATE): the same
layouts, masks and softmax on any CPU, for tests and for checking the algorithm off AMX.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins._kit.cbuild import build, prebuild
from plugins.attention.cpu_c.backend import CpuCAttentionAvx512, CpuCMeta

SOURCE = Path(__file__).with_name("attn_amx.c")
BUILDS = ("amx", "emulated")


@functools.cache
def library(kind: str = "amx") -> ctypes.CDLL:
    """attn_amx.c built on real tiles (`amx`: the process is granted the AMX tile state first)
    or on plain-C emulated ones (`emulated`: any CPU). RuntimeError when it cannot be built or
    the tile state is refused."""
    if kind == "amx":
        lib = build(SOURCE, "amx")
    elif kind == "emulated":
        lib = build(SOURCE, "portable", ("-DAMX_EMULATE",))
    else:
        raise ValueError(f"unknown attn_amx build {kind!r} (known: {', '.join(BUILDS)})")
    p, i64, i32, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.amx_attn_extend.argtypes = [p, p, p, i64, i64, p, i64, p, p, p, i64, i64, i64, i64, i64,
                                    f, i64, f, p, i32]
    lib.amx_attn_extend.restype = i32
    lib.amx_attn_variant.restype = ctypes.c_char_p
    if lib.amx_attn_init() != 0:
        raise RuntimeError("the kernel did not grant this process the AMX tile state "
                           "(arch_prctl ARCH_REQ_XCOMP_PERM)")
    return lib


def takes(head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernel takes these head dims (K in 32-wide tile chunks, V in 16-wide)."""
    return head_dim > 0 and v_head_dim > 0 and head_dim % 32 == 0 and v_head_dim % 16 == 0


def extend_attention(lib: ctypes.CDLL, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor, scaling: float,
                     window: int | None = None, softcap: float | None = None,
                     threads: int | None = None) -> torch.Tensor:
    """Causal extend attention from the pool: q [T, H, D] bf16 (requests back to back),
    k_buf [S, Hkv, D] / v_buf [S, Hkv, Dv] bf16 (rows may be strided: slot stride any),
    slots [B, >= max seq] int64 (request b's token j at slot slots[b, j]), lens [3, B] int64
    (prefix lengths, extend lengths, each request's first row in q) -> [T, H * Dv] bf16."""
    T, H, D = q.shape
    Hkv, Dv = k_buf.shape[1], v_buf.shape[-1]
    if q.dtype != torch.bfloat16 or k_buf.dtype != torch.bfloat16 \
            or v_buf.dtype != torch.bfloat16:
        raise ValueError(f"cpu_amx extend takes bf16 q and KV, got {q.dtype} / {k_buf.dtype}")
    if not takes(D, Dv) or H % Hkv or k_buf.shape[2] != D:
        raise ValueError(f"cpu_amx extend takes head dims multiple of 32 (K) / 16 (V) and H a "
                         f"multiple of Hkv, got H={H} Hkv={Hkv} D={D} Dv={Dv}")
    if k_buf.stride(1) != D or k_buf.stride(2) != 1 or v_buf.stride(1) != Dv \
            or v_buf.stride(2) != 1:
        raise ValueError("cpu_amx extend needs each slot's heads contiguous in the pool")
    q = q.contiguous()
    assert slots.dtype == torch.int64 and slots.is_contiguous()
    assert lens.dtype == torch.int64 and lens.is_contiguous() and lens.shape[0] == 3
    B = lens.shape[1]
    out = torch.empty(T, H * Dv, dtype=torch.bfloat16)
    rc = lib.amx_attn_extend(
        q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), v_buf.stride(0),
        slots.data_ptr(), slots.stride(0), lens[0].data_ptr(), lens[1].data_ptr(),
        lens[2].data_ptr(), B, H, Hkv, D, Dv, scaling, window or 0, softcap or 0.0,
        out.data_ptr(), threads or torch.get_num_threads())
    if rc == -2:
        raise MemoryError("cpu_amx extend attention: out of memory")
    if rc != 0:
        raise RuntimeError(f"cpu_amx extend attention failed ({rc})")
    return out


@dataclass
class CpuAmxMeta(CpuCMeta):
    """cpu_c's step metadata plus, for an extend the tiles run, the requests' lengths as one
    tensor [3, B]: prefix lengths, extend lengths, first rows."""

    lens_t: torch.Tensor | None = None


class CpuAmxAttention(CpuCAttentionAvx512):
    """Extend on AMX tiles (bf16, not short); decode and short extends as cpu_c_avx512."""

    label = "cpu_amx attention"
    build_kind = "amx"

    @classmethod
    def prebuild(cls) -> None:
        """core.plan.prebuild's hook: attn.c (decode) and attn_amx.c (extend) compiled into
        the cache for this backend's builds."""
        super().prebuild()
        if cls.build_kind == "amx":
            prebuild(SOURCE, "amx")
        else:
            prebuild(SOURCE, "portable", ("-DAMX_EMULATE",))

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        self.tiles = library(self.build_kind)

    def prepare(self, batch: ForwardBatch) -> CpuAmxMeta:
        meta = CpuAmxMeta(**vars(super().prepare(batch)))
        if (not meta.decode and meta.rows is None and self.ctx.dtype == torch.bfloat16
                and meta.extend_lens and max(meta.extend_lens) > 0):
            meta.slots = meta.slots.contiguous()
            meta.lens_t = torch.tensor([meta.prefix_lens, meta.extend_lens, meta.starts],
                                       dtype=torch.int64)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        meta = self._meta(batch)
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        Dv = layer.v_head_dim or D
        pool = batch.kv_pool
        if (getattr(meta, "lens_t", None) is None or q.dtype != torch.bfloat16
                or layer.sinks is not None or not takes(D, Dv)
                or pool.get_kv_buffer(layer.layer_id)[0].dtype != torch.bfloat16):
            return super().forward(q, k, v, layer, batch)  # decode, short or fp32 extends
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, Dv))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        return extend_attention(self.tiles, q.view(T, H, D), k_buf, v_buf, meta.slots,
                                meta.lens_t, layer.scaling, layer.sliding_window,
                                layer.logit_softcap, self.threads)


class CpuAmxEmulated(CpuAmxAttention):
    """The same backend on emulated tiles and cpu_c's portable decode: runs on any CPU (tests;
    not registered)."""

    label = "cpu_amx attention (emulated tiles)"
    build_kind = "emulated"
    variant = "portable"
