"""Numba decode attention over the paged KV cache, for CPUs.

One task per request: for each of its tokens, the slot's K row (all KV heads, contiguous in the
pool) is read once and scored against every query head; a softmax per head follows; then each V
row is read once and accumulated into every query head of its group. Reading the pool directly (no
padded gather, no dense copy) touches only the batch's real tokens; each row is prefetched in
software a few tokens ahead (PREFETCH_AHEAD), since a request's slots are not one stream.

bf16 caches are passed as their uint16 bit patterns and widened to fp32 as they are read (a shift
and a register bitcast: bf16 is the top half of an fp32). Scores, softmax and the
accumulation are fp32 whatever the storage.

Requests are split over the threads in batch order (numba's static schedule). Handing them out
longest first was slower on the 2-core machine this was written on (both threads then stream
long rows at once). A batch of one request runs on one thread.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The fp32 whose bit pattern is the uint32 `bits` (a register bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# Rows prefetched ahead of the one being read: a request's slots are runs of consecutive
# (ascending or descending) rows interleaved with single decode-time slots, which the hardware
# prefetcher follows poorly; 2..8 rows ahead halved the time of a cold (30-layer) sweep here.
PREFETCH_AHEAD = 4


@intrinsic
def _prefetch(typingctx, addr):
    """Prefetch the cache line at address `addr` (llvm.prefetch: read, keep in all levels)."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(types.intp), codegen


@njit(inline="always")
def _prefetch_row(buf, slot):
    base = buf.ctypes.data + slot * buf.strides[0]
    for c in range(0, buf.strides[0], 64):
        _prefetch(base + c)


def _at(buf, s, g, d):  # pragma: no cover - replaced by the overloads below in jit code
    raise NotImplementedError


@overload(_at)
def _at_impl(buf, s, g, d):
    """buf[s, g, d] as fp32; a uint16 buffer holds bf16 bit patterns (the top half of an fp32)."""
    if buf.dtype == types.uint16:
        def widen(buf, s, g, d):
            return _f32_from_bits(np.uint32(buf[s, g, d]) << np.uint32(16))
        return widen

    def as_is(buf, s, g, d):
        return buf[s, g, d]
    return as_is


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy", nogil=True)
def decode_attention(q, k_buf, v_buf, slots, seq_lens, scale, window, cap, out):
    """q [B, H, D] fp32; k_buf [S, Hkv, D], v_buf [S, Hkv, Dv] (fp32, or uint16 = bf16);
    slots [B, >=L] int64 slot of each request's token j; seq_lens [B]; window > 0 keeps the
    last `window` keys (0 = all); cap > 0 soft-caps the scaled scores (cap * tanh(s / cap));
    out [B, H, Dv] fp32."""
    B, H, D = q.shape
    Hkv = k_buf.shape[1]
    Dv = v_buf.shape[2]
    G = H // Hkv
    for b in prange(B):
        L = seq_lens[b]
        lo = L - window if window > 0 and L > window else 0
        qs = np.empty((H, D), np.float32)
        for h in range(H):
            for d in range(D):
                qs[h, d] = q[b, h, d] * scale
        sc = np.empty((H, L), np.float32)
        mx = np.full(H, -np.inf, np.float32)
        for j in range(lo, L):
            if j + PREFETCH_AHEAD < L:
                _prefetch_row(k_buf, slots[b, j + PREFETCH_AHEAD])
            s = slots[b, j]
            for g in range(Hkv):
                for i in range(G):
                    h = g * G + i
                    a = np.float32(0.0)
                    for d in range(D):
                        a += qs[h, d] * _at(k_buf, s, g, d)
                    if cap > 0:
                        a = cap * np.tanh(a / cap)
                    sc[h, j] = a
                    if a > mx[h]:
                        mx[h] = a
        den = np.zeros(H, np.float32)
        for h in range(H):
            for j in range(lo, L):
                e = np.exp(sc[h, j] - mx[h])
                sc[h, j] = e
                den[h] += e
        acc = np.zeros((H, Dv), np.float32)
        for j in range(lo, L):
            if j + PREFETCH_AHEAD < L:
                _prefetch_row(v_buf, slots[b, j + PREFETCH_AHEAD])
            s = slots[b, j]
            for g in range(Hkv):
                for i in range(G):
                    h = g * G + i
                    p = sc[h, j]
                    for d in range(Dv):
                        acc[h, d] += p * _at(v_buf, s, g, d)
        for h in range(H):
            r = np.float32(1.0) / den[h]
            for d in range(Dv):
                out[b, h, d] = acc[h, d] * r
