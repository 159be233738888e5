"""`cpu_c` attention: torch_native's prefill, a C kernel (attn.c) for decode and for short extends
(speculative verify steps) on the CPU."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from core.contract.native import NativeFn
from plugins._kit.cbuild import build, prebuild
from plugins._kit.pool_attention import PoolDecodeAttention
from plugins._kit.torch_attention import TorchNativeMeta

SOURCE = Path(__file__).with_name("attn.c")


@functools.cache
def library(variant: str) -> SimpleNamespace:
    """attn.c's entry points for one ISA build, each a NativeFn (core.contract.native: a CPU
    decode graph records their calls)."""
    lib = build(SOURCE, variant)
    p, i64, i32, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    # ca_decode_rows and ca_decode_tab: one more pointer than ca_decode (row offsets / rows)
    two_arrays = [p, i32, p, p, i32, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64, f, i64, f,
                  p, i32, i32]
    return SimpleNamespace(
        ca_decode=NativeFn(lib.ca_decode, [p, i32, p, p, i32, p, i64, p, i64, i64, i64, i64, i64,
                                           i64, i64, f, i64, f, p, i32, i32]),
        ca_decode_rows=NativeFn(lib.ca_decode_rows, two_arrays),
        ca_decode_tab=NativeFn(lib.ca_decode_tab, two_arrays),
        ca_mla_decode=NativeFn(lib.ca_mla_decode, [p, p, i32, i64, p, i64, p, i64, i64, i64,
                                                   i64, f, p, i32]))


# An extend whose requests add at most this many tokens each (speculative verify: the last
# token and up to 15 drafts) runs as decode rows through the C kernel
# (plugins/_kit/pool_attention.py), each request's rows one work item (ca_decode_rows: the
# request's cache read about once for all its rows), so a verify step rounds exactly as decode
# steps do: greedy answers with speculation on are those with it off, whatever the quant method
# (with int8 activations, `gguf_*_q8`, the prefill path's rounding changed greedy answers on 8
# of 16 bench prompts; bench/RESULTS.md).
SHORT_EXTEND = 16


@dataclass
class CpuCMeta(TorchNativeMeta):
    """torch_native's step metadata plus, for decode, the sequence lengths as a tensor, and for
    a short extend the decode rows that run it."""

    seq_lens_t: torch.Tensor | None = None  # [B] int64
    rows: CpuCMeta | None = None
    first: torch.Tensor | None = None  # decode rows: [requests + 1] row offsets (int64)
    # a decode graph's (prepare_for_graph): the static table [*, C] int32, each request's row
    # in it [B] int64 and its length [B] int32, read by ca_decode_tab at every replay
    table: torch.Tensor | None = None
    table_rows: torch.Tensor | None = None
    lens32: torch.Tensor | None = None


class CpuCAttention(PoolDecodeAttention):
    """Decode reads the paged pool in place (no gather, no dense copy); extend is inherited."""

    label = "cpu_c attention"
    variant = "portable"
    native_bf16_q = True  # q fp32 or bf16 in, out in q's dtype
    # compute dtypes whose short extends run as decode rows (see SHORT_EXTEND)
    rows_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

    @classmethod
    def prebuild(cls) -> None:
        """core.plan.prebuild's hook: attn.c compiled for this variant into the cache."""
        prebuild(SOURCE, cls.variant)

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        lib = library(self.variant)
        self.fn, self.fn_rows, self.fn_tab = lib.ca_decode, lib.ca_decode_rows, lib.ca_decode_tab
        self.threads = torch.get_num_threads()

    def decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               layer: AttentionLayerParams, meta: CpuCMeta) -> torch.Tensor:
        B, H, D = q.shape
        Hkv, Dv = k_buf.shape[1], v_buf.shape[-1]
        q_bf = int(q.dtype == torch.bfloat16)
        out = torch.empty(B, H * Dv, dtype=q.dtype)
        tail = (H, Hkv, D, Dv, k_buf.stride(0), v_buf.stride(0), layer.scaling,
                layer.sliding_window or 0, layer.logit_softcap or 0.0, out.data_ptr(), q_bf,
                self.threads)
        if meta.table is not None:  # a decode graph's static metadata
            t = meta.table
            rc = self.fn_tab(q.data_ptr(), q_bf, k_buf.data_ptr(), v_buf.data_ptr(),
                             int(k_buf.dtype == torch.bfloat16), t.data_ptr(), t.stride(0),
                             meta.table_rows.data_ptr(), meta.lens32.data_ptr(), B, *tail)
            if rc != 0:
                raise MemoryError("cpu_c decode attention: out of memory")
            return out
        slots, lens = meta.slots, meta.seq_lens_t
        head = (q.data_ptr(), q_bf, k_buf.data_ptr(), v_buf.data_ptr(),
                int(k_buf.dtype == torch.bfloat16), slots.data_ptr(), slots.stride(0),
                lens.data_ptr())
        if meta.first is None:
            rc = self.fn(*head, B, *tail)
        else:
            rc = self.fn_rows(*head, meta.first.data_ptr(), meta.first.numel() - 1, *tail)
        if rc == -1:
            raise ValueError(f"cpu_c decode rows: a request adds more than {SHORT_EXTEND} tokens")
        if rc != 0:
            raise MemoryError("cpu_c decode attention: out of memory")
        return out

    def prepare_for_graph(self, batch: ForwardBatch, bs: int) -> CpuCMeta:
        """A decode graph's metadata: the kernel reads the batch's static table, rows and
        lengths (int32, written before each replay) through ca_decode_tab; no Python list of
        lengths, no per-step gather."""
        table, rows, lens = batch.req_to_token, batch.req_pool_indices, batch.seq_lens
        if (table.dtype != torch.int32 or table.stride(1) != 1 or rows.dtype != torch.int64
                or lens.dtype != torch.int32 or not rows.is_contiguous()
                or not lens.is_contiguous()):
            raise ValueError(f"{self.label} graphs read an int32 table and lengths and int64 "
                             f"rows, got {table.dtype}, {lens.dtype}, {rows.dtype}")
        return CpuCMeta(True, None, [], [], [], [], table=table, table_rows=rows, lens32=lens)

    def prepare(self, batch: ForwardBatch) -> CpuCMeta:
        meta = CpuCMeta(**vars(super().prepare(batch)))
        if meta.decode:
            meta.slots = meta.slots.contiguous()
            meta.seq_lens_t = torch.as_tensor(meta.seq_lens, dtype=torch.int64)
        elif (self.ctx.dtype in self.rows_dtypes and meta.extend_lens
              and 0 < max(meta.extend_lens) <= SHORT_EXTEND):
            # token j of request b: a decode row over b's first prefix + j + 1 tokens
            owner = [b for b, n in enumerate(meta.extend_lens) for _ in range(n)]
            lens = [p + j + 1 for p, n in zip(meta.prefix_lens, meta.extend_lens, strict=True)
                    for j in range(n)]
            slots = meta.slots[torch.as_tensor(owner, dtype=torch.long)].contiguous()
            first = [0]
            for n in meta.extend_lens:
                first.append(first[-1] + n)
            meta.rows = CpuCMeta(True, slots, lens, [n - 1 for n in lens], [1] * len(lens),
                                 list(range(len(lens))),
                                 seq_lens_t=torch.as_tensor(lens, dtype=torch.int64),
                                 first=torch.as_tensor(first, dtype=torch.int64))
        return meta


class CpuCAttentionAvx512(CpuCAttention):
    variant = "avx512_vnni"


class CpuCAttentionAvx2(CpuCAttention):
    variant = "avx2"
