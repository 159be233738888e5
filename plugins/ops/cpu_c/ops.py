"""core.contract.layer_ops over ops.c (ctypes): each op one C call instead of 3-8 torch ops.

At batch 1 a SmolLM2 layer's element-wise work is a few thousand elements: torch's per-op
dispatch (2-5 us each, ~20 ops per layer) costs more than the arithmetic. An op falls back to
the reference (returns None, or calls it) for inputs it does not take: dtypes other than fp32 /
bf16, strides other than row-major.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from core.contract.native import NativeFn
from core.layers import ops_ref
from plugins._kit.cbuild import build, prebuild

SOURCE = Path(__file__).with_name("ops.c")
_BF = {torch.float32: 0, torch.bfloat16: 1}
_REFERENCE = ops_ref.TorchLayerOps()  # what an op falls back to for inputs it does not take


@functools.cache
def library(variant: str) -> SimpleNamespace:
    """ops.c's entry points for one ISA build, each a NativeFn (core.contract.native: a CPU
    decode graph records their calls); all return nothing."""
    lib = build(SOURCE, variant)
    p, i64, i32, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    sigs = {"co_rms_norm": [p, i64, p, p, i64, i64, f, i32, i32],
            "co_add_rms_norm": [p, p, p, p, p, i64, i64, f, i32, i32],
            "co_silu_mul": [p, p, i64, i64, i32, i32],
            "co_rotary": [p, i64, p, p, p, p, i64, i64, i64, i64, i32, i32],
            "co_store_kv": [p, i64, p, i64, p, p, p, i64, i64, i64, i32, i32]}
    return SimpleNamespace(**{name: NativeFn(getattr(lib, name), args, restype=None)
                              for name, args in sigs.items()})


def _rows(x: torch.Tensor) -> bool:
    """2-D, last dim contiguous (rows may be apart), on the CPU."""
    return x.dim() == 2 and x.stride(-1) == 1 and x.device.type == "cpu"


class CpuLayerOps:
    """The layer ops in C for one compute dtype (fp32 / bf16) on the CPU."""

    name = "cpu_c"
    variant = "portable"

    @classmethod
    def prebuild(cls) -> None:
        """core.plan.prebuild's hook: ops.c compiled for this variant into the cache."""
        prebuild(SOURCE, cls.variant)

    def __init__(self, dtype: Any = None, device: Any = None):
        self.dtype, self.device = dtype, device
        self.lib = library(self.variant)
        self.threads = torch.get_num_threads()

    def rms_norm(self, weight: torch.Tensor, eps: float) -> Callable | None:
        if weight.dtype not in _BF:
            return None
        fn, n, bf, threads = self.lib.co_rms_norm, weight.shape[0], _BF[weight.dtype], self.threads
        w = weight.detach().contiguous()
        wp = w.data_ptr()
        ref = _REFERENCE.rms_norm(weight, eps)

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != w.dtype or x.shape[-1] != n:
                return ref(x)
            x2 = x if x.dim() == 2 else x.reshape(-1, n)
            if not _rows(x2):
                return ref(x)
            y = torch.empty(x2.shape, dtype=x.dtype)
            fn(x2.data_ptr(), x2.stride(0), wp, y.data_ptr(), x2.shape[0], n, eps, bf, threads)
            return y.reshape(x.shape)

        run.keep = w  # the weight the pointer points into
        return run

    def add_rms_norm(self, weight: torch.Tensor, eps: float) -> Callable | None:
        if weight.dtype not in _BF:
            return None
        fn, n, bf, threads = self.lib.co_add_rms_norm, weight.shape[0], _BF[weight.dtype], \
            self.threads
        w = weight.detach().contiguous()
        wp = w.data_ptr()
        ref = _REFERENCE.add_rms_norm(weight, eps)

        def run(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if (x.dtype != w.dtype or residual.dtype != w.dtype or x.dim() != 2
                    or x.shape != residual.shape or x.shape[1] != n or not x.is_contiguous()
                    or not residual.is_contiguous()):
                return ref(x, residual)
            y = torch.empty_like(x)
            total = torch.empty_like(x)
            fn(x.data_ptr(), residual.data_ptr(), wp, y.data_ptr(), total.data_ptr(), x.shape[0],
               n, eps, bf, threads)
            return y, total

        run.keep = w
        return run

    def silu_and_mul(self) -> Callable | None:
        fn, threads = self.lib.co_silu_mul, self.threads

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.dtype not in _BF or x.dim() != 2 or not x.is_contiguous():
                return ops_ref.silu_and_mul(x)
            t, i = x.shape[0], x.shape[1] // 2
            y = torch.empty(t, i, dtype=x.dtype)
            fn(x.data_ptr(), y.data_ptr(), t, i, _BF[x.dtype], threads)
            return y

        return run

    def rotary_qk(self, head_dim: int) -> Callable | None:
        fn, threads, d = self.lib.co_rotary, self.threads, head_dim

        def run(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                num_k: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = qkv.shape[0]
            c, s = cos.reshape(t, -1), sin.reshape(t, -1)
            if (qkv.dtype not in _BF or not _rows(qkv) or cos.dtype != qkv.dtype
                    or sin.dtype != qkv.dtype or c.shape[1] != d or not c.is_contiguous()
                    or not s.is_contiguous() or d % 2):
                return ops_ref.rotary_qk(qkv, cos, sin, num_q, num_k, d)
            q = torch.empty(t, num_q * d, dtype=qkv.dtype)
            k = torch.empty(t, num_k * d, dtype=qkv.dtype)
            fn(qkv.data_ptr(), qkv.stride(0), c.data_ptr(), s.data_ptr(), q.data_ptr(),
               k.data_ptr(), t, num_q, num_k, d, _BF[qkv.dtype], threads)
            return q, k

        return run

    def store_kv(self) -> Callable | None:
        fn = self.lib.co_store_kv

        def run(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor) -> bool:
            t = k.shape[0]
            if t == 0:
                return True
            k2, v2 = k.reshape(t, -1), v.reshape(t, -1)
            if (k.dtype not in _BF or v.dtype != k.dtype or k_buf.dtype not in _BF
                    or v_buf.dtype != k_buf.dtype or k2.stride(-1) != 1 or v2.stride(-1) != 1
                    or not k_buf.is_contiguous() or not v_buf.is_contiguous()
                    or loc.dtype != torch.int64 or not loc.is_contiguous()
                    or k_buf.stride(0) != k2.shape[1] or v_buf.stride(0) != v2.shape[1]):
                return False
            fn(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0), loc.data_ptr(),
               k_buf.data_ptr(), v_buf.data_ptr(), t, k2.shape[1], v2.shape[1],
               _BF[k.dtype], _BF[k_buf.dtype])
            return True

        return run


class CpuLayerOpsAvx512(CpuLayerOps):
    variant = "avx512_vnni"


class CpuLayerOpsAvx2(CpuLayerOps):
    variant = "avx2"
