"""The Triton kernels of the fused MoE runner (imported only when the runner is built).

Rows: one per (token, slot) assignment, id a = token * top_k + slot, N = T * top_k of them. The
runner sorts the ids by expert and pads each expert's group to a multiple of BLOCK_M with the
id N (`sorted_ids`); `block_expert[b]` is the expert of row block b and `total` (a device
scalar) the padded row count: blocks at or past it exit at once, so the grid can be sized for
the worst case without a host sync.

- gate_up_kernel: inter[a, :] = act(x[a // k] @ Wg[e].T) * (x[a // k] @ Wu[e].T), both halves of
  w13 in one program (two accumulators over the same A tile); ACTIVATION is the layer's
  (core.contract.moe.ACTIVATIONS: silu, gelu in its erf form, or GPT-OSS's clamped swigluoai
  with its alpha and limit), computed in fp32 on the accumulators (after the biases);
- down_kernel: partial[a, :] = w_route[a] * (inter[a] @ W2[e].T); with FUSE_SUM (decode-sized
  steps) the last program of each column of output tiles (an atomic count per column, reset by
  that program) also sums each token's k rows in slot order (+ shared) into the output, which
  spares the separate reduction launch.
With FP8_BLOCK (form "fp8" of core.contract.moe with block scales), W is e4m3 with a scale per
SCALE_N x BLOCK_K block and each A tile is quantized per row in the kernel (one scale per
BLOCK_K inputs, as the fp8 linears do); every K step is rescaled once into the fp32 accumulator.
With MXFP4 (form "mxfp4": packed e2m1 + e8m0 scales, plugins/_kit/mxfp4.py) W is uint8 [E, N,
K/2] with a scale byte per 32 inputs, multiplied with x as it is (weight-only), one of two ways:
MX_DOT "" decodes each B tile in registers (_mxfp4_tile: exact in fp32, then cast to x's dtype;
any dtype), MX_DOT "bf16" / "fp16" (x's format) hands the packed tile and its scales to
tl.dot_scaled, Triton's own MX product (upcast by the compiler where the GPU has no fp4 MMA). With HAS_BIAS a
per-expert bias [E, N] (fp32) is added to the product (any weight form): before the activation
for gate/up, before the routing weight for down.
The k partial rows of a token are summed in a fixed order (by the runner, or by down_kernel's
FUSE_SUM tail: its atomics only count, they add nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _quantize_rows(a, q_ty: tl.constexpr):
    """A [rows, BLOCK_K] activation tile -> (tile / scale as q_ty, fp32 scale per row):
    amax / 448, the e4m3 range (fp16 stands in for e4m3 under the interpreter); the tile times
    the scale's reciprocal, both divisions IEEE-rounded (core.contract.quant.reciprocal). Triton's `/`
    is approximate, and half-precision inputs often put a / scale exactly on a midpoint of the
    e4m3 grid, where its last bit picks the code (bench/diag_moe_fp8.py found whole tokens off
    by 1e-2 in fp16 from this)."""
    a32 = a.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a32), axis=1), 1e-12), 448.0)
    inv = tl.math.div_rn(scale * 0.0 + 1.0, scale)
    return (a32 * inv[:, None]).to(q_ty), scale


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, offs_k, offs_n, mask, stride_wn, stride_sn, stride_sk,
                out_ty: tl.constexpr):
    """B tile [BLOCK_K, BLOCK_N] = W[n, k] of one expert's packed rows (w_ptr / s_ptr at the
    expert), for the inputs offs_k and rows offs_n: element k is nibble k % 2 (low first) of
    byte k // 2, times 2^(scale[n, k // 32] - 127). Both factors are built from their bits, so
    the fp32 product is exact (0xFF scales are NaN, 0 is 2^-127); then cast to out_ty."""
    rows = offs_n[None, :].to(tl.int64)
    byte = tl.load(w_ptr + rows * stride_wn + (offs_k // 2)[:, None], mask=mask,
                   other=0).to(tl.int32)
    code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
    e = (code >> 1) & 3
    m = code & 1
    # e2m1 -> fp32 bits: exponent e - 1 (bias 1) rebiased to 127, or 0.5 * m when e = 0
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    value = (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    s = tl.load(s_ptr + rows * stride_sn + (offs_k // 32)[:, None] * stride_sk, mask=mask,
                other=127).to(tl.int32)
    s_bits = tl.where(s == 0, 1 << 22, tl.where(s == 255, 0x7FC00000, s << 23))
    return (value * s_bits.to(tl.float32, bitcast=True)).to(out_ty)


@triton.jit
def _mxfp4_dot_scaled(a, w_ptr, s_ptr, k0, offs_n, n_mask, k_size, stride_wn, stride_sn,
                      stride_sk, acc, MX_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ W^T for one expert's packed rows offs_n (w_ptr / s_ptr at
    the expert) and inputs [k0, k0 + BLOCK_K), by tl.dot_scaled: the bytes as its [K/2, N]
    e2m1 operand (low nibble first, as stored), the scales as its [N, K/32] e8m0 ones. The
    inputs past k_size (a multiple of 32) read as zero codes at scale 1."""
    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    rows = offs_n.to(tl.int64)
    w = tl.load(w_ptr + rows[None, :] * stride_wn + offs_j[:, None],
                mask=(offs_j < k_size // 2)[:, None] & n_mask[None, :], other=0)
    s = tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :] * stride_sk,
                mask=n_mask[:, None] & (offs_g < k_size // 32)[None, :], other=127)
    return tl.dot_scaled(a, None, MX_DOT, w, s, "e2m1", acc)


@triton.jit
def _glu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """The gated activation of fp32 [gate | up] tiles (core.contract.moe.gated_activation), in
    fp32: silu(gate) * up; gelu's exact erf form; or GPT-OSS's swigluoai, gate clamped to at
    most `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    if ACTIVATION == "swigluoai":
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        y = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    elif ACTIVATION == "gelu":
        y = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        y = gate * tl.sigmoid(gate) * up
    return y


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr,
                   num_rows, hidden, inter, top_k,
                   stride_xm, stride_we, stride_wn, stride_om,
                   ws_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be,
                   swiglu_alpha, swiglu_limit,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, FP8_BLOCK: tl.constexpr, SCALE_N: tl.constexpr,
                   MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                   MX_DOT: tl.constexpr = "", ACTIVATION: tl.constexpr = "silu"):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(sorted_ids_ptr + offs_m)
    valid = row < num_rows
    token = (row // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    # B tiles [BLOCK_K, BLOCK_N]: w13[e, n, k] read transposed; up rows start `inter` below
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
        + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        if MXFP4 and MX_DOT != "":  # packed rows: byte and scale offsets from k, not g_ptrs
            w_e = w_ptr + expert * stride_we
            s_e = ws_ptr + expert * stride_se
            acc_g = _mxfp4_dot_scaled(a, w_e, s_e, k0, offs_n, n_mask, hidden, stride_wn,
                                      stride_sn, stride_sk, acc_g, MX_DOT, BLOCK_K)
            acc_u = _mxfp4_dot_scaled(a, w_e + inter * stride_wn, s_e + inter * stride_sn, k0,
                                      offs_n, n_mask, hidden, stride_wn, stride_sn, stride_sk,
                                      acc_u, MX_DOT, BLOCK_K)
        elif MXFP4:
            w_e = w_ptr + expert * stride_we
            s_e = ws_ptr + expert * stride_se
            g = _mxfp4_tile(w_e, s_e, k0 + offs_k, offs_n, b_mask, stride_wn, stride_sn,
                            stride_sk, x_ptr.dtype.element_ty)
            u = _mxfp4_tile(w_e + inter * stride_wn, s_e + inter * stride_sn, k0 + offs_k,
                            offs_n, b_mask, stride_wn, stride_sn, stride_sk,
                            x_ptr.dtype.element_ty)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        elif FP8_BLOCK:
            g = tl.load(g_ptrs, mask=b_mask, other=0.0)
            u = tl.load(u_ptrs, mask=b_mask, other=0.0)  # x quantized per BLOCK_K inputs here, w13 scaled per SCALE_N x BLOCK_K
            aq, a_s = _quantize_rows(a, w_ptr.dtype.element_ty)
            s_row = ws_ptr + expert * stride_se + (k0 // BLOCK_K) * stride_sk
            sg = tl.load(s_row + (offs_n // SCALE_N) * stride_sn, mask=n_mask, other=0.0)
            su = tl.load(s_row + ((offs_n + inter) // SCALE_N) * stride_sn, mask=n_mask,
                         other=0.0)
            acc_g += tl.dot(aq, g).to(tl.float32) * a_s[:, None] * sg[None, :]
            acc_u += tl.dot(aq, u).to(tl.float32) * a_s[:, None] * su[None, :]
        else:
            g = tl.load(g_ptrs, mask=b_mask, other=0.0)
            u = tl.load(u_ptrs, mask=b_mask, other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        acc_g += tl.load(b_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = _glu(acc_g, acc_u, swiglu_alpha, swiglu_limit, ACTIVATION)
    o_ptrs = out_ptr + row[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_tile(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_expert_ptr, pid_m, pid_n,
               num_rows, hidden, inter, stride_am, stride_we, stride_wn, stride_om,
               ws_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, FP8_BLOCK: tl.constexpr, SCALE_N: tl.constexpr,
               MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, MX_DOT: tl.constexpr):
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(sorted_ids_ptr + offs_m)
    valid = row < num_rows
    row64 = row.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row64[:, None] * stride_am + offs_k[None, :]
    # B tile [BLOCK_K, BLOCK_N]: w2[e, n, k] (n over hidden, k over inter) read transposed
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
        + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if MXFP4 and MX_DOT != "":
            acc = _mxfp4_dot_scaled(a, w_ptr + expert * stride_we, ws_ptr + expert * stride_se,
                                    k0, offs_n, n_mask, inter, stride_wn, stride_sn, stride_sk,
                                    acc, MX_DOT, BLOCK_K)
        elif MXFP4:
            b = _mxfp4_tile(w_ptr + expert * stride_we, ws_ptr + expert * stride_se,
                            k0 + offs_k, offs_n, k_mask[:, None] & n_mask[None, :], stride_wn,
                            stride_sn, stride_sk, a_ptr.dtype.element_ty)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        elif FP8_BLOCK:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            aq, a_s = _quantize_rows(a, w_ptr.dtype.element_ty)
            sb = tl.load(ws_ptr + expert * stride_se + (offs_n // SCALE_N) * stride_sn
                         + (k0 // BLOCK_K) * stride_sk, mask=n_mask, other=0.0)
            acc += tl.dot(aq, b).to(tl.float32) * a_s[:, None] * sb[None, :]
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_mask,
                       other=0.0).to(tl.float32)[None, :]
    route = tl.load(route_ptr + row, mask=valid, other=0.0)
    acc = acc * route[:, None]
    o_ptrs = out_ptr + row64[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def down_kernel(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr,
                num_rows, hidden, inter,
                stride_am, stride_we, stride_wn, stride_om,
                ws_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be,
                sum_ptr, shared_ptr, lock_ptr, top_k, stride_sum, stride_shared,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, FP8_BLOCK: tl.constexpr, SCALE_N: tl.constexpr,
                FUSE_SUM: tl.constexpr = False, HAS_SHARED: tl.constexpr = False,
                MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                MX_DOT: tl.constexpr = ""):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    busy = pid_m * BLOCK_M < tl.load(total_ptr)
    if not FUSE_SUM:
        if not busy:
            return
        _down_tile(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_expert_ptr, pid_m,
                   pid_n, num_rows, hidden, inter, stride_am, stride_we, stride_wn, stride_om,
                   ws_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be, BLOCK_M,
                   BLOCK_N, BLOCK_K, PRECISION, FP8_BLOCK, SCALE_N, MXFP4, HAS_BIAS, MX_DOT)
    else:
        # decode: the last program of each column of output tiles sums every token's k rows
        # in slot order (+ shared) into sum_ptr [T, hidden]; idle programs only count
        if busy:
            _down_tile(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_expert_ptr,
                       pid_m, pid_n, num_rows, hidden, inter, stride_am, stride_we, stride_wn,
                       stride_om, ws_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, FP8_BLOCK, SCALE_N, MXFP4,
                       HAS_BIAS, MX_DOT)
        tl.debug_barrier()  # every thread's rows are written before the count moves
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hidden
            for t in range(0, num_rows // top_k):
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for j in range(0, top_k):
                    part = tl.load(out_ptr + (t * top_k + j) * stride_om + offs_n, mask=n_mask,
                                   other=0.0, cache_modifier=".cg")
                    acc += part.to(tl.float32)
                y = acc.to(sum_ptr.dtype.element_ty)
                if HAS_SHARED:  # rounded like the PyTorch path: the sum, then + shared
                    sh = tl.load(shared_ptr + t * stride_shared + offs_n, mask=n_mask, other=0.0)
                    y = (y.to(tl.float32) + sh.to(tl.float32)).to(sum_ptr.dtype.element_ty)
                tl.store(sum_ptr + t * stride_sum + offs_n, y, mask=n_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next call (graph replays too)


def grid(num_blocks: int, n: int, block_n: int) -> tuple[int, int]:
    return (num_blocks, triton.cdiv(n, block_n))
