"""The layer-ops conformance tests: every op a layer-ops plugin provides against the reference
(core/layers/ops_ref.py, plain PyTorch), computed in fp32 from the same inputs.

Collected by the conformance plugin (`pytest --conformance-layer-ops NAME`, see
conformance.plugin), or by importing them into a test module:

    from conformance.layer_ops_suite import *  # noqa: F401,F403

Parametrization: every registered layer-ops plugin that can run on each suite device (or only
those named), every declared compute dtype (not bf16 under the Triton interpreter), every op of
core.contract.layer_ops.OPS. An op the plugin does not declare (LayerOpsCaps.ops) and does not
provide (its method is absent or returns None for every input tried) is a skip with the reason:
the layers then run the reference; an op it declares but returns None for on every input the
suite tries, in a dtype it declares, is a failure (the caps promise what the plugin does not
do). Per op: odd sizes, a strided view where the model passes one, empty batches, outputs of
the right shape, dtype and device, inputs left unchanged, and (store_kv) exactly the addressed
slots written. The norms (rms_norm, add_rms_norm, qk_norm_rotary, both of norm_add_norm) also
get an all-zero row and rows of small norm (1e-3, 1e-4: mean(x^2) at or below eps), where eps
must sit inside the square root, rsqrt(mean(x^2) + eps), as the reference has it: outside it
(x / (rms + eps)) or missing, those rows come out wrong or not finite.
"""

from __future__ import annotations

import pytest
import torch

from conformance.attention_check import excluded_dtype_reasons
from conformance.suite_kit import Target, suite_params
from core.contract.layer_ops import OPS, OPTIONAL_OPS
from core.layers.ops_ref import TorchLayerOps
from core.plan.registry import get_registry

__all__ = ["pytest_generate_tests", "test_layer_ops_conformance"]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
REFERENCE = "torch"


def layer_ops_params(config: pytest.Config) -> list:
    def cases(t: Target) -> list:
        excluded = excluded_dtype_reasons(t.reg, t.device)
        return [pytest.param(t.name, t.device_name, dtype, op,
                             id=f"{t.name}-{t.device_name}-{dtype}-{op}", marks=t.marks)
                for dtype in sorted(t.reg.caps.dtypes) if dtype not in excluded for op in OPS]

    # an absent device: one skip per named plugin, saying why (none for the whole device)
    return suite_params(config, "layer_ops", "conformance_layer_ops", "layer-ops plugin", cases,
                        width=4, device_skip=False, say_device=False)

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_layer_ops_conformance":
        metafunc.parametrize("plugin,device,dtype,op", layer_ops_params(metafunc.config))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype],
                               msg=lambda m: f"{what}: {m}")


SMALL_ROWS = (0.0, 1e-3, 1e-4)  # an all-zero row, then rows of small norm (see the docstring)


def _small_rows(x: torch.Tensor, n_head: int | None = None) -> None:
    """Scale the first rows of x [T, N] (or the first head of `n_head` columns of each of the
    first tokens) by SMALL_ROWS, in place."""
    for i, s in enumerate(SMALL_ROWS[:x.shape[0]]):
        if n_head is None:
            x[i] *= s
        else:
            x[i, :n_head] *= s


def _cos_sin(d: int, positions: torch.Tensor, base: float, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, 1, d] as RotaryEmbedding.cos_sin gives them (sin = [-s, s]) for
    `positions` [T] (fp32) at rope base `base`."""
    ang = positions[:, None] / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(dtype=dtype, device=device)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)[:, None].to(dtype=dtype, device=device)
    return cos, sin


def _not_provided(op: str, dtype: torch.dtype, declared: frozenset[str] | None, why: str
                  ) -> None:
    """Nothing of `op` ran: a failure when the plugin declares it, else a skip with `why`."""
    if declared is None or op in declared:
        raise AssertionError(
            f"{op} is declared (LayerOpsCaps.ops) but the plugin provided it for none of the "
            f"{dtype} inputs the suite tried (its method is absent or returned None): declare "
            "only the ops it provides")
    pytest.skip(f"{op} not declared (LayerOpsCaps.ops) and not provided for {dtype}: {why}")


def _check(op: str, ops, ref, dtype: torch.dtype, device: torch.device,
           declared: frozenset[str] | None = None) -> None:
    """One op of `ops` against the reference `ref`; `declared`: the plugin's LayerOpsCaps.ops
    (None: every op counts as declared)."""
    g = torch.Generator(device="cpu").manual_seed(OPS.index(op))

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    fn = getattr(ops, op, None)
    if fn is None:  # an optional op (core.contract.layer_ops.OPTIONAL_OPS) the plugin leaves out
        _not_provided(op, dtype, declared, "the layers compose it from the plugin's other ops "
                                           "or run the reference")
    if op in ("rms_norm", "add_rms_norm"):
        for n, t in ((96, 5), (576, 3), (4096, 2), (64, 0)):
            w = (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=device)
            f, r = fn(w, 1e-6), getattr(ref, op)(w, 1e-6)
            if f is None:
                _not_provided(op, dtype, declared, "the layers run the reference")
            x, res = rnd(t, n), rnd(t, n)
            _small_rows(x)
            _small_rows(res)  # x + residual small too (add_rms_norm normalizes the sum)
            x0, res0 = x.clone(), res.clone()
            if op == "rms_norm":
                _close(f(x), r(x), dtype, f"rms_norm n={n} t={t}")
                # a row-strided view, as MLA passes the latent part of kv_a's output
                xs = rnd(t, n + 64)[:, :n]
                _small_rows(xs)
                _close(f(xs), r(xs), dtype, f"rms_norm n={n} t={t} (rows strided)")
            else:
                (out, total), (rout, rtotal) = f(x, res), r(x, res)
                _close(total, rtotal, dtype, f"add_rms_norm sum n={n}")
                _close(out, rout, dtype, f"add_rms_norm norm n={n}")
            assert torch.equal(x, x0) and torch.equal(res, res0), f"{op} changed its inputs"
    elif op == "norm_add_norm":
        ran = False
        # Gemma-2-9B's hidden size (3584: not a power of two), small and odd ones, a batch
        for n, t in ((96, 7), (576, 3), (3584, 2), (37, 4), (64, 0)):
            w1 = (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=device)
            w2 = (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=device)
            f = fn(w1, w2, 1e-6)
            if f is None:
                continue  # not fused for these weights: the layers compose it
            ran = True
            # the residual stream larger than the attention output, as in a model
            h, res = rnd(t, n, scale=3.0), rnd(t, n, scale=8.0)
            # the first rows' h zero (norm1(0) = 0): the sum is the residual's zero and small
            # rows (norm2's eps); the next rows' h zero and small (norm1's eps)
            k = min(t, len(SMALL_ROWS))
            h[:k] = 0
            _small_rows(res)
            _small_rows(h[k:])
            h0, res0 = h.clone(), res.clone()
            (out, total), (rout, rtotal) = f(h, res), ref.norm_add_norm(w1, w2, 1e-6)(h, res)
            _close(total, rtotal, dtype, f"norm_add_norm sum n={n} t={t}")
            _close(out, rout, dtype, f"norm_add_norm norm n={n} t={t}")
            assert torch.equal(h, h0) and torch.equal(res, res0), f"{op} changed its inputs"
        if not ran:
            _not_provided(op, dtype, declared, "the layers compose it from rms_norm and "
                                               "add_rms_norm")
    elif op == "silu_and_mul":
        f = fn()
        if f is None:
            _not_provided(op, dtype, declared, "the layers run the reference")
        for t, i in ((7, 96), (1, 1408), (0, 64), (3, 37)):  # 37: a vector kernel's tail
            x = rnd(t, 2 * i)
            _close(f(x), ref.silu_and_mul()(x), dtype, f"silu_and_mul t={t} i={i}")
    elif op == "gelu_and_mul":
        ran = False
        for approximate in ("tanh", "none"):
            f = fn(approximate)
            if f is None:
                continue  # this form not provided: the reference computes it
            ran = True
            # 3 sigma: gelu's flat negative tail and its near-linear positive side both hit
            for t, i in ((7, 96), (1, 3584), (0, 64), (3, 37)):
                x = rnd(t, 2 * i, scale=3.0)
                _close(f(x), ref.gelu_and_mul(approximate)(x), dtype,
                       f"gelu_and_mul({approximate}) t={t} i={i}")
        if not ran:
            _not_provided(op, dtype, declared, "the layers run the reference")
    elif op == "rotary_qk":
        ran = False
        for d, hq, hk, t in ((64, 4, 2, 5), (128, 8, 1, 3), (80, 2, 2, 2)):
            f = fn(d)
            if f is None:
                continue  # not provided at this head size: the reference rotates it
            ran = True
            pos = torch.arange(t, dtype=torch.float32) * 3
            cos, sin = _cos_sin(d, pos, 1e4, dtype, device)
            qkv = rnd(t, (hq + 2 * hk) * d)
            q, k = f(qkv, cos, sin, hq, hk)
            rq, rk = ref.rotary_qk(d)(qkv, cos, sin, hq, hk)
            _close(q, rq, dtype, f"rotary q d={d}")
            _close(k, rk, dtype, f"rotary k d={d}")
        if not ran:
            _not_provided(op, dtype, declared, "the reference rotates q and k")
    elif op == "qk_norm_rotary":
        ran = False
        # Qwen3-30B-A3B's heads (32 q, 4 kv of 128), odd head counts, a head size the
        # kernels may refuse (80), a lone token and a batch; qkv as the projection gives it
        for d, hq, hk, t in ((128, 32, 4, 1), (64, 5, 3, 4), (128, 4, 1, 3), (80, 2, 2, 2),
                             (64, 2, 1, 0)):
            qw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
            kw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
            f = fn(d, qw, kw, 1e-6)
            if f is None:
                continue  # not fused at this head size: the layers compose it
            ran = True
            pos = torch.arange(t, dtype=torch.float32) * 7 + 1
            cos, sin = _cos_sin(d, pos, 1e6, dtype, device)
            # scaled like real activations (the norm divides the scale out); the first tokens'
            # first q head, and k head (after the q heads), zero or of small norm
            qkv = rnd(t, (hq + 2 * hk) * d, scale=3.0)
            _small_rows(qkv, d)
            _small_rows(qkv[:, hq * d:], d)
            qkv0 = qkv.clone()
            q, k = f(qkv, cos, sin, hq, hk)
            rq, rk = ref.qk_norm_rotary(d, qw, kw, 1e-6)(qkv, cos, sin, hq, hk)
            _close(q, rq, dtype, f"qk_norm_rotary q d={d} heads={hq}/{hk} t={t}")
            _close(k, rk, dtype, f"qk_norm_rotary k d={d} heads={hq}/{hk} t={t}")
            assert q.is_contiguous() and k.is_contiguous(), "q / k must be contiguous"
            assert torch.equal(qkv, qkv0), "qk_norm_rotary changed its input"
        if not ran:
            _not_provided(op, dtype, declared, "the layers compose it")
    elif op == "rotary_mla":
        ran = False
        # DeepSeek's 16 (V2-Lite) and 128 heads of rope 64, interleaved; odd head counts; the
        # half layout; an empty batch. q and k as views into the projections (strided rows)
        for h, d, t, inter in ((16, 64, 3, True), (128, 64, 1, True), (5, 32, 4, False),
                               (3, 64, 2, False), (7, 16, 5, True), (4, 64, 0, True)):
            f = fn(d, inter)
            if f is None:
                continue  # not provided at this rope size: the reference rotates them
            ran = True
            pos = torch.arange(t, dtype=torch.float32) * 5 + 2
            cos, sin = _cos_sin(d, pos, 1e4, dtype, device)
            q = rnd(t, h, 48 + d)[..., 48:]  # the rope part of each head, after its nope part
            k = rnd(t, 40 + d)[:, 40:]  # k_rope after the latent in kv_a's output
            q0, k0 = q.clone(), k.clone()
            rq, rk = f(q, k, cos, sin)
            wq, wk = ref.rotary_mla(d, inter)(q, k, cos, sin)
            what = f"rotary_mla heads={h} d={d} t={t} interleaved={inter}"
            assert rq.shape == (t, h, d) and rk.shape == (t, d), what
            _close(rq, wq, dtype, f"{what}: q")
            _close(rk, wk, dtype, f"{what}: k")
            assert rq.is_contiguous() and rk.is_contiguous(), f"{what}: q / k must be contiguous"
            assert torch.equal(q, q0) and torch.equal(k, k0), "rotary_mla changed its inputs"
        if not ran:
            _not_provided(op, dtype, declared, "the reference rotates q and k")
    elif op == "linear":
        # decode's rows (1..4), a prefill's (the plugin may hand those to the BLAS), odd sizes,
        # K long enough to be split, with and without bias, x a strided row view
        ran = False
        for m, n, kk, bias in ((1, 128, 2048, False), (3, 200, 520, True), (4, 64, 4096, False),
                               (2, 5120, 256, True), (9, 96, 160, True), (1, 33, 70, False),
                               (0, 16, 64, False)):
            w = rnd(n, kk, scale=kk ** -0.5)
            b = rnd(n) if bias else None
            f = fn(w, b)
            if f is None:
                continue  # not taken for this weight: the layers use F.linear
            ran = True
            x = rnd(m, 2 * kk)[:, :kk]  # rows strided like a slice of a wider activation
            x0, w0 = x.clone(), w.clone()
            _close(f(x), ref.linear(w, b)(x), dtype, f"linear m={m} n={n} k={kk} bias={bias}")
            assert torch.equal(x, x0) and torch.equal(w, w0), "linear changed its inputs"
        if not ran:
            _not_provided(op, dtype, declared, "the layers use F.linear")
    elif op == "store_kv":
        f = fn()
        if f is None:
            _not_provided(op, dtype, declared, "the pool writes K/V itself")
        t, hkv, d, size = 6, 2, 32, 40
        qkv = rnd(t, (4 + 2 * hkv) * d)
        k = rnd(t, hkv, d)
        v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)  # a strided view, as the model passes it
        kb = torch.full((size, hkv, d), 7.0, dtype=dtype, device=device)
        vb = kb.clone()
        loc = torch.tensor([3, 39, 0, 12, 13, 5], device=device)
        if not f(k, v, loc, kb, vb):
            pytest.skip("store_kv declined these tensors: the pool writes them itself")
        assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
        rest = torch.ones(size, dtype=torch.bool, device=device)
        rest[loc] = False
        assert (kb[rest] == 7).all() and (vb[rest] == 7).all(), "store_kv wrote other slots"


def test_layer_ops_conformance(plugin, device, dtype, op):
    reg = get_registry().get("layer_ops", plugin)
    dev, dt = torch.device(device), getattr(torch, dtype)
    ops = reg.load()(dtype=dt, device=dev)
    missing = [m for m in OPS if not hasattr(ops, m) and m not in OPTIONAL_OPS]
    assert not missing, f"{plugin} lacks {missing} (core/contract/layer_ops.py: return None instead)"
    _check(op, ops, TorchLayerOps(dt, dev), dt, dev, reg.caps.ops)
