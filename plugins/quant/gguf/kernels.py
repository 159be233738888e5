"""Call kernels.c through ctypes: one library per ISA variant, built on first use
(plugins/_kit/cbuild.py)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from core.contract.native import NativeFn
from plugins._kit.cbuild import build
from plugins.quant.gguf.formats import Packed

SOURCE = Path(__file__).with_name("kernels.c")


@functools.cache
def library(variant: str) -> ctypes.CDLL:
    """kernels.c built for `variant`, with its functions' signatures declared."""
    lib = build(SOURCE, variant)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    # NativeFn (core.contract.native): a CPU decode graph records these calls
    lib.linear = NativeFn(lib.gq_linear, [p, i32, i64, i64, p, i32, i32, p, p, i32, p, p, i32,
                                          i64, i32, i32])
    lib.dequant = NativeFn(lib.gq_dequant, [p, i32, i32, p, p, i32, i64, i64, p, i64, p, i32,
                                            i32])
    lib.gq_variant.restype = ctypes.c_char_p
    if lib.gq_variant().decode() != variant:
        raise RuntimeError(f"the {variant} build of kernels.c reports {lib.gq_variant().decode()}")
    return lib


_DT = {torch.float32: 0, torch.bfloat16: 1}


def _product(x: torch.Tensor, k: int, n: int, out_dtype: torch.dtype | None, takes: str,
             failed: str, launch) -> torch.Tensor:
    """x [..., K] (fp32 / bf16) -> y [..., N] in out_dtype (x's): checks x, hands launch(x2
    [M, K] contiguous, M, y [M, N]) the buffers; a nonzero return is `failed`.format(rc)."""
    dt = out_dtype or x.dtype
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in _DT or dt not in _DT:
        raise ValueError(f"{takes} fp32 / bf16, got {x.dtype} -> {dt}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=dt)
    rc = launch(x2, x2.shape[0], y)
    if rc != 0:
        raise RuntimeError(failed.format(rc))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


class Kernels:
    """The products of one ISA variant over Packed matrices, with activations quantized per
    block to `act_bits` 16 (|error| <= 2^-16 of the block's largest value, finer than bf16)
    or 8 (llama.cpp's Q8 activations: faster, and greedy outputs drift further from fp32)."""

    def __init__(self, variant: str, act_bits: int = 16):
        if act_bits not in (8, 16):
            raise ValueError(f"activation bits must be 8 or 16, not {act_bits}")
        self.variant = variant
        self.act_bits = act_bits
        self.lib = library(variant)

    def linear(self, x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] (fp32 / bf16) @ W^T (+ bias, fp32) -> [..., N] in out_dtype (x's)."""
        return self.bind(w, bias, out_dtype)(x)

    def bind(self, w: Packed, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None):
        """x -> linear(x, w, bias) with the weight's arguments bound once (the decode hot
        path: ~3 us of Python per call instead of ~10)."""
        n, k = w.shape
        fn = self.lib.linear
        wargs = (w.codes.data_ptr(), w.bits, w.bs, w.scales.data_ptr(), w.mins.data_ptr(),
                 int(w.scales.dtype == torch.float32),
                 bias.data_ptr() if bias is not None else None)
        threads, abits = torch.get_num_threads(), self.act_bits
        keep = (w, bias)  # the pointers stay valid while the closure lives

        failed = f"gq_linear failed ({{}}) for {w.bits}-bit blocks of {w.bs}"

        def launch(x2: torch.Tensor, m: int, y: torch.Tensor) -> int:
            return fn(x2.data_ptr(), _DT[x2.dtype], m, k, *wargs, y.data_ptr(), _DT[y.dtype], n,
                      abits, threads)

        def run(x: torch.Tensor) -> torch.Tensor:
            return _product(x, k, n, out_dtype, "GGUF kernels take", failed, launch)

        run.keep = keep
        return run

    def dequantize(self, w: Packed, dtype: torch.dtype,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix (or its rows `rows`, int64) dense in fp32 / bf16."""
        n, k = w.shape
        idx = None
        if rows is not None:  # range-checked by the kernel (no host read: graphs record this)
            idx = rows.reshape(-1)
            if idx.dtype != torch.int64 or not idx.is_contiguous():
                idx = idx.to(torch.int64).contiguous()
        count = n if idx is None else idx.numel()
        out = torch.empty(count, k, dtype=dtype)
        rc = self.lib.dequant(w.codes.data_ptr(), w.bits, w.bs, w.scales.data_ptr(),
                              w.mins.data_ptr(), int(w.scales.dtype == torch.float32), k, n,
                              idx.data_ptr() if idx is not None else None, count,
                              out.data_ptr(), _DT[dtype], torch.get_num_threads())
        if rc == -3:
            raise IndexError(f"row index out of range for {n} rows")
        if rc != 0:
            raise RuntimeError(f"gq_dequant failed ({rc})")
        return out if rows is None else out.reshape(*rows.shape, k)


AMX_SOURCE = Path(__file__).with_name("amx.c")


@functools.cache
def amx_library() -> ctypes.CDLL:
    """amx.c built for the `amx` variant, with the process granted the AMX tile state
    (RuntimeError when the compiler cannot build it or the kernel refuses the state)."""
    lib = build(AMX_SOURCE, "amx")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.linear = NativeFn(lib.gq_amx_linear, [p, i64, i64, p, i32, i32, p, p, i32, p, p, i32,
                                              i64, i32])
    lib.q_linear = NativeFn(lib.gq_amx_q_linear, [p, i32, i64, i64, p, i32, p, p, i32, p, p,
                                                  i32, i64, i32])
    lib.gq_amx_q_pack.argtypes = [p, i32, p, p, i32, i64, i64, p, p, p]
    lib.gq_amx_q_pack.restype = i32
    lib.gq_amx_variant.restype = ctypes.c_char_p
    if lib.gq_amx_init() != 0:
        raise RuntimeError("the kernel did not grant this process the AMX tile state "
                           "(arch_prctl ARCH_REQ_XCOMP_PERM)")
    return lib


class AmxKernels:
    """x @ W^T over Packed matrices on AMX tiles (amx.c), the weights kept in their blocks:
    - `bind`: bf16 x on bf16 tiles; each call dequantizes the weight panel by panel into the
      tiles' layout and streams every row of x past it (prefill);
    - `bind_int`: fp32 or bf16 x on int8 tiles with the gguf kernels' arithmetic (int16
      activations per block, exact integer sums; kernels.c), for blocks of 32 (batched decode,
      and prefill under fp32)."""

    def __init__(self):
        self.lib = amx_library()

    @staticmethod
    def _wargs(w: Packed, bias: torch.Tensor | None) -> tuple:
        return (w.codes.data_ptr(), w.bits, w.bs, w.scales.data_ptr(), w.mins.data_ptr(),
                int(w.scales.dtype == torch.float32),
                bias.data_ptr() if bias is not None else None)

    def bind(self, w: Packed, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None):
        """x -> x @ W^T (+ bias, fp32) in out_dtype (x's); x bf16 [..., K]."""
        n, k = w.shape
        if k % 32 or (w.bits == 4 and w.bs != 32) or w.bs not in (16, 32):
            raise ValueError(f"AMX kernel takes K a multiple of 32 and blocks of 16 / 32, "
                             f"not K={k} with {w.bits}-bit blocks of {w.bs}")
        fn = self.lib.linear
        wargs = self._wargs(w, bias)
        threads = torch.get_num_threads()
        keep = (w, bias)

        def run(x: torch.Tensor) -> torch.Tensor:
            dt = out_dtype or x.dtype
            if x.dtype != torch.bfloat16 or dt not in _DT:
                raise ValueError(f"the AMX kernel takes bf16 activations, got {x.dtype} -> {dt}")
            if x.shape[-1] != k:
                raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
            x2 = x.reshape(-1, k)
            m = x2.shape[0]
            pad = -m % 32  # the tiles read whole blocks of 32 rows
            if pad or not x2.is_contiguous():
                x2 = torch.cat((x2, x2.new_zeros(pad, k))) if pad else x2.contiguous()
            y = torch.empty(m, n, dtype=dt)
            rc = fn(x2.data_ptr(), m, k, *wargs, y.data_ptr(), _DT[dt], n, threads)
            if rc != 0:
                raise RuntimeError(f"gq_amx_linear failed ({rc})")
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

        run.keep = keep
        return run

    @staticmethod
    def takes_int(w: Packed) -> bool:
        """Whether bind_int takes this matrix (blocks of 32, K a multiple of 32)."""
        return w.bs == 32 and w.shape[1] % 32 == 0

    def int_tiles(self, w: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w's codes, scales and mins in the int8 tiles' order (gq_amx_q_pack), made once per
        matrix and kept on it: half a byte per 4-bit weight (one per 8-bit), beside the codes
        the VNNI kernel reads."""
        held = getattr(w, "amx_int_tiles", None)
        if held is not None:
            return held
        n, k = w.shape
        panels, nb = (n + 15) // 16, k // 32
        tiles = torch.empty(panels * nb * (256 if w.bits == 4 else 512), dtype=torch.uint8)
        sc = torch.empty(panels * nb * 16, dtype=w.scales.dtype)
        mn = torch.empty_like(sc)
        rc = self.lib.gq_amx_q_pack(w.codes.data_ptr(), w.bits, w.scales.data_ptr(),
                                    w.mins.data_ptr(), int(w.scales.dtype == torch.float32),
                                    n, k, tiles.data_ptr(), sc.data_ptr(), mn.data_ptr())
        if rc != 0:
            raise RuntimeError(f"gq_amx_q_pack failed ({rc})")
        w.amx_int_tiles = (tiles, sc, mn)
        return w.amx_int_tiles

    def bind_int(self, w: Packed, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None):
        """x -> x @ W^T (+ bias, fp32) in out_dtype (x's); x fp32 or bf16 [..., K]."""
        n, k = w.shape
        if not self.takes_int(w):
            raise ValueError(f"the AMX int8 kernel takes blocks of 32 and K a multiple of 32, "
                             f"not K={k} with blocks of {w.bs}")
        fn = self.lib.q_linear
        tiles, sc, mn = self.int_tiles(w)
        wargs = (tiles.data_ptr(), w.bits, sc.data_ptr(), mn.data_ptr(),
                 int(sc.dtype == torch.float32), bias.data_ptr() if bias is not None else None)
        threads = torch.get_num_threads()
        keep = (tiles, sc, mn, bias)

        def launch(x2: torch.Tensor, m: int, y: torch.Tensor) -> int:
            return fn(x2.data_ptr(), _DT[x2.dtype], m, k, *wargs, y.data_ptr(), _DT[y.dtype], n,
                      threads)

        def run(x: torch.Tensor) -> torch.Tensor:
            return _product(x, k, n, out_dtype, "the AMX kernel takes", "gq_amx_q_linear failed "
                            "({})", launch)

        run.keep = keep
        return run
