"""Fused element-wise kernels for the decoder layers on GPUs (Triton), with the same math as the
reference layer ops (core/layers/ops_ref.py) they replace.

Why: at batch 1 an 8B model's decode step is ~30 small kernels per layer besides the matmuls
(RMSNorm alone is six: cast, square, mean, rsqrt, multiply, scale); each costs 1-3 us of GPU time
even inside a CUDA graph, ~1.5 ms a step on an H200 against a 3.8 ms weights roofline. Fused:
- `add_rms_norm`: (x + residual) and RMSNorm of it in one pass (HF rounding: the sum in the
  compute dtype, the norm in fp32, cast back before the weight);
- `rms_norm`: the same without the residual;
- `norm_add_norm`: Gemma's sandwich: RMSNorm of h, its residual add and the next RMSNorm of the
  sum in one pass (two kernels otherwise: rms_norm, then add_rms_norm);
- `silu_and_mul`: silu(gate) * up over a stacked [gate | up] projection; `gelu_and_mul` the
  same with gelu (tanh or erf form: Gemma's GeGLU, two element-wise kernels otherwise);
- `rotary_qk`: rotary embedding of the q and k heads of a fused qkv output, written to two
  contiguous tensors (no strided copies afterwards);
- `store_kv`: both K and V of a step into the paged pool in one kernel.
- `qk_norm_rotary`: Qwen3's RMSNorm over each q and k head (its own weight for q and for k),
  then rotary, for every head of the batch in one kernel (in PyTorch: two copies, two norms and
  six element-wise ops a layer).
- `rotary_mla`: MLA's rotary on every q head's rope part and the shared k_rope of a step in one
  kernel, DeepSeek's interleaved pairs taken apart on the way (in PyTorch: two copies and six
  element-wise ops a layer).

The `triton` layer-ops plugin (plugins/ops/triton/__init__.py) serves them to the layers on CUDA
and ROCm; tests call the functions directly under TRITON_INTERPRET=1 on the CPU. Triton is
imported on first use, never at import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    """Compile-on-demand kernel namespace (imports triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o,
                        stride_s, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + row * stride_o + cols, out, mask=m)

    @triton.jit
    def norm_add_norm_kernel(h_ptr, res_ptr, w1_ptr, w2_ptr, out_ptr, sum_ptr, stride_h,
                             stride_r, stride_o, stride_s, N, eps, BLOCK: tl.constexpr):
        # one row: s = residual + norm1(h), norm2(s); each norm as rms_norm_kernel's, norm1(h)
        # and s rounded to h's dtype as the two kernels it replaces round them
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        h = tl.load(h_ptr + row * stride_h + cols, mask=m, other=0.0)
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        w1 = tl.load(w1_ptr + cols, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols, mask=m, other=0.0).to(tl.float32)
        hf = h.to(tl.float32)
        y = (hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)).to(h.dtype)
        n1 = (w1 * y.to(tl.float32)).to(h.dtype)
        s = (n1.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=m)
        sf = s.to(tl.float32)
        y = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)).to(h.dtype)
        tl.store(out_ptr + row * stride_o + cols, (w2 * y.to(tl.float32)).to(h.dtype), mask=m)

    @triton.jit
    def act_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, ACT: tl.constexpr,
                       BLOCK: tl.constexpr):
        # act(gate) * up; ACT: 0 silu, 1 gelu (tanh form), 2 gelu (erf form)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=m, other=0.0)
        gf = g.to(tl.float32)
        if ACT == 0:
            a = gf / (1.0 + tl.exp(-gf))
        elif ACT == 1:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(y) = 1 - 2 / (1 + e^2y)
            y = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
            a = 0.5 * gf * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
        else:  # 0.5 x (1 + erf(x / sqrt(2)))
            a = 0.5 * gf * (1.0 + tl.math.erf(gf * 0.7071067811865476))
        # the activation rounded like torch's, then the product
        out = (a.to(g.dtype).to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        tl.store(out_ptr + row * stride_o + cols, out, mask=m)

    @triton.jit
    def rotary_kernel(x_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_xt, stride_ct, stride_st,
                      NQ, NH, HEADS: tl.constexpr, HALF: tl.constexpr):
        # one token per program, all its q and k heads: x[t, h, :] of a [T, NH, 2*HALF] view
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        hm = h < NH
        base = x_ptr + t * stride_xt + h * (2 * HALF)
        x1 = tl.load(base + d, mask=hm, other=0.0)
        x2 = tl.load(base + HALF + d, mask=hm, other=0.0)
        c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)  # sin carries rotate_half's sign
        s2 = tl.load(sin_ptr + t * stride_st + HALF + d).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (f1 * c1 + f2 * s1).to(x1.dtype)
        o2 = (f2 * c2 + f1 * s2).to(x1.dtype)
        is_q = h < NQ
        q_off = t * (NQ * 2 * HALF) + h * (2 * HALF)
        k_off = t * ((NH - NQ) * 2 * HALF) + (h - NQ) * (2 * HALF)
        tl.store(q_ptr + q_off + d, o1, mask=hm & is_q)
        tl.store(q_ptr + q_off + HALF + d, o2, mask=hm & is_q)
        kmask = hm & (h >= NQ)
        tl.store(k_ptr + k_off + d, o1, mask=kmask)
        tl.store(k_ptr + k_off + HALF + d, o2, mask=kmask)

    @triton.jit
    def rotary_mla_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh,
                          stride_kt, stride_ct, stride_st, H, HEADS: tl.constexpr,
                          HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        # one token per program: its H q heads and its k_rope (an extra head), Dr = 2 * HALF
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        hm = h < H
        if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...: first halves x0, x2, .., seconds x1, ..
            i1, i2 = 2 * d, 2 * d + 1
        else:
            i1, i2 = d, HALF + d
        c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)  # sin carries rotate_half's sign
        s2 = tl.load(sin_ptr + t * stride_st + HALF + d).to(tl.float32)
        qb = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(qb + i1, mask=hm, other=0.0)
        x2 = tl.load(qb + i2, mask=hm, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        ob = qo_ptr + t * (H * 2 * HALF) + h * (2 * HALF)
        tl.store(ob + d, (f1 * c1 + f2 * s1).to(x1.dtype), mask=hm)
        tl.store(ob + HALF + d, (f2 * c2 + f1 * s2).to(x1.dtype), mask=hm)
        y1 = tl.load(k_ptr + t * stride_kt + i1).to(tl.float32)  # [1, HALF]
        y2 = tl.load(k_ptr + t * stride_kt + i2).to(tl.float32)
        kb = ko_ptr + t * (2 * HALF)
        tl.store(kb + d, (y1 * c1 + y2 * s1).to(ko_ptr.dtype.element_ty))
        tl.store(kb + HALF + d, (y2 * c2 + y1 * s2).to(ko_ptr.dtype.element_ty))

    @triton.jit
    def qk_norm_rotary_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_xt,
                              stride_ct, stride_st, NQ, NH, eps, HB: tl.constexpr,
                              HALF: tl.constexpr):
        # program (t, b): heads [b * HB, + HB) of token t of a [T, NH, 2*HALF] view; each head
        # is RMS-normed (fp32, cast back, times its weight) and then rotated, as the reference
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]
        d = tl.arange(0, HALF)[None, :]
        hm = h < NH
        base = x_ptr + t * stride_xt + h * (2 * HALF)
        x1 = tl.load(base + d, mask=hm, other=0.0)
        x2 = tl.load(base + HALF + d, mask=hm, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, None]
        is_q = h < NQ
        w1 = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d), tl.load(kw_ptr + HALF + d)).to(tl.float32)
        n1 = (w1 * (f1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        n2 = (w2 * (f2 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)  # sin carries rotate_half's sign
        s2 = tl.load(sin_ptr + t * stride_st + HALF + d).to(tl.float32)
        o1 = (n1 * c1 + n2 * s1).to(x1.dtype)
        o2 = (n2 * c2 + n1 * s2).to(x1.dtype)
        q_off = t * (NQ * 2 * HALF) + h * (2 * HALF)
        k_off = t * ((NH - NQ) * 2 * HALF) + (h - NQ) * (2 * HALF)
        qmask = hm & is_q
        tl.store(q_ptr + q_off + d, o1, mask=qmask)
        tl.store(q_ptr + q_off + HALF + d, o2, mask=qmask)
        kmask = hm & (h >= NQ)
        tl.store(k_ptr + k_off + d, o1, mask=kmask)
        tl.store(k_ptr + k_off + HALF + d, o2, mask=kmask)

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, loc_ptr, kbuf_ptr, vbuf_ptr, stride_k, stride_v, N,
                        BLOCK: tl.constexpr):
        # one token per program: its K row and V row ([kv_heads * head_dim] each) into its slot
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(loc_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        kx = tl.load(k_ptr + t * stride_k + cols, mask=m)
        vx = tl.load(v_ptr + t * stride_v + cols, mask=m)
        tl.store(kbuf_ptr + slot * N + cols, kx.to(kbuf_ptr.dtype.element_ty), mask=m)
        tl.store(vbuf_ptr + slot * N + cols, vx.to(vbuf_ptr.dtype.element_ty), mask=m)

    class K:
        pass

    k = K()
    k.triton = triton
    k.rms_norm = rms_norm_kernel
    k.norm_add_norm = norm_add_norm_kernel
    k.act_mul = act_mul_kernel
    k.rotary = rotary_kernel
    k.qk_norm_rotary = qk_norm_rotary_kernel
    k.rotary_mla = rotary_mla_kernel
    k.store_kv = store_kv_kernel
    return k


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of a 2-D (or row-contiguous) tensor."""
    x2 = x.reshape(-1, x.shape[-1])
    N = x2.shape[1]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        k = _kernels()
        block = k.triton.next_power_of_2(N)
        k.rms_norm[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                   N, eps, HAS_RES=False, BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [T, N] tensors."""
    T, N = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    if T:
        k = _kernels()
        block = k.triton.next_power_of_2(N)
        k.rms_norm[(T,)](x, residual, weight, out, total, x.stride(0), residual.stride(0),
                         out.stride(0), total.stride(0), N, eps, HAS_RES=True, BLOCK=block,
                         num_warps=_warps(block))
    return out, total


def norm_add_norm(h: torch.Tensor, residual: torch.Tensor, weight1: torch.Tensor,
                  weight2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s, weight2), s), s = residual + rms_norm(h, weight1), for [T, N] tensors."""
    T, N = h.shape
    out = torch.empty_like(h)
    total = torch.empty_like(h)
    if T:
        k = _kernels()
        block = k.triton.next_power_of_2(N)
        k.norm_add_norm[(T,)](h, residual, weight1, weight2, out, total, h.stride(0),
                              residual.stride(0), out.stride(0), total.stride(0), N, eps,
                              BLOCK=block, num_warps=_warps(block))
    return out, total


def _gated(x: torch.Tensor, act: int) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up, [T, I]; act_mul_kernel's ACT."""
    T, two_i = x.shape
    n = two_i // 2
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    if T:
        k = _kernels()
        block = min(1024, k.triton.next_power_of_2(n))
        k.act_mul[(T, k.triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, ACT=act,
                                                BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    return _gated(x, 0)


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """[T, 2I] (gate | up) -> gelu(gate) * up, [T, I]; approximate "tanh" or "none" (erf)."""
    return _gated(x, 1 if approximate == "tanh" else 2)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int, num_k: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the q and k heads at the front of a [T, (num_q + num_k + ...) * D] projection.

    cos / sin: [T, 1, D] as RotaryEmbedding.cos_sin gives them (sin = [-s, s]).
    Returns q [T, num_q * D] and k [T, num_k * D], contiguous.
    """
    T = qkv.shape[0]
    q = torch.empty(T, num_q * head_dim, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(T, num_k * head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        k = _kernels()
        heads = num_q + num_k
        k.rotary[(T,)](qkv, cos, sin, q, k_out, qkv.stride(0), cos.stride(0), sin.stride(0),
                       num_q, heads, HEADS=k.triton.next_power_of_2(heads), HALF=head_dim // 2,
                       num_warps=4)
    return q, k_out


def rotary_mla(q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rope [T, H, Dr] and k_rope [T, Dr] (any strides with a unit last one), cos / sin
    [T, 1, Dr] as RotaryEmbedding.cos_sin gives them -> rotated q [T, H, Dr] and k [T, Dr],
    contiguous; interleaved: the pairs are de-interleaved first (ops_ref.rotary_mla)."""
    T, H, D = q_rope.shape
    q = torch.empty(T, H, D, dtype=q_rope.dtype, device=q_rope.device)
    k_out = torch.empty(T, D, dtype=k_rope.dtype, device=k_rope.device)
    if T:
        k = _kernels()
        k.rotary_mla[(T,)](q_rope, k_rope, cos, sin, q, k_out, q_rope.stride(0),
                           q_rope.stride(1), k_rope.stride(0), cos.stride(0), sin.stride(0), H,
                           HEADS=k.triton.next_power_of_2(H), HALF=D // 2,
                           INTERLEAVED=interleaved, num_warps=4)
    return q, k_out


QK_NORM_HEADS = 4  # heads per program of qk_norm_rotary: several programs even at batch 1


def qk_norm_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                   num_k: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each q head (q_weight) and k head (k_weight) at the front of a
    [T, (num_q + num_k + ...) * D] projection (rows contiguous), then rotary (cos / sin as for
    rotary_qk). Returns q [T, num_q * D] and k [T, num_k * D], contiguous."""
    T = qkv.shape[0]
    q = torch.empty(T, num_q * head_dim, dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty(T, num_k * head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        k = _kernels()
        heads = num_q + num_k
        grid = (T, k.triton.cdiv(heads, QK_NORM_HEADS))
        k.qk_norm_rotary[grid](qkv, q_weight, k_weight, cos, sin, q, k_out, qkv.stride(0),
                               cos.stride(0), sin.stride(0), num_q, heads, eps,
                               HB=QK_NORM_HEADS, HALF=head_dim // 2, num_warps=2)
    return q, k_out


STORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def can_store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                 v_buf: torch.Tensor) -> bool:
    """store_kv handles this: rows of [heads, dim] contiguous within a token, buffers contiguous
    with the same row shape, no fp8 (those keep the pool's own write and its scaling)."""
    return (k.dtype in STORE_DTYPES and k.dim() == 3 and v.dim() == 3 and k.shape == v.shape
            and k_buf.dtype in STORE_DTYPES and k_buf.dtype == v_buf.dtype
            and k_buf.shape[1:] == k.shape[1:] and v_buf.shape[1:] == v.shape[1:]
            and k_buf.is_contiguous() and v_buf.is_contiguous()
            and k.stride(2) == 1 and v.stride(2) == 1
            and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2])


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor,
             v_buf: torch.Tensor) -> None:
    """k_buf[loc] = k; v_buf[loc] = v (cast to the buffers' dtype) in one kernel."""
    T = k.shape[0]
    if T:
        kern = _kernels()
        n = k.shape[1] * k.shape[2]
        block = kern.triton.next_power_of_2(n)
        kern.store_kv[(T,)](k, v, loc, k_buf, v_buf, k.stride(0), v.stride(0), n, BLOCK=block,
                            num_warps=4)
