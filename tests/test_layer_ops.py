"""The layer-ops conformance suite over every registered layer-ops plugin (conformance's
layer_ops_suite): on the CPU the reference and, under the Triton interpreter, the triton ops in
fp32 / fp16; on a GPU (`-m gpu`) every declared dtype."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from conformance.layer_ops_suite import *  # noqa: E402,F401,F403
from conformance.layer_ops_suite import layer_ops_params  # noqa: E402


def test_the_suite_covers_every_op_of_both_built_in_plugins(pytestconfig):
    ids = {p.id for p in layer_ops_params(pytestconfig)}
    gpu = torch.cuda.is_available()
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv",
               "qk_norm_rotary", "linear", "rotary_mla", "gelu_and_mul", "norm_add_norm"):
        assert f"torch-cpu-float32-{op}" in ids
        if gpu:  # the GPU kernels run on the GPU, in every dtype they declare
            assert f"triton-cuda-bfloat16-{op}" in ids and f"triton-cuda-float16-{op}" in ids
        else:
            assert f"triton-cpu-float16-{op}" in ids  # the interpreter runs the GPU kernels here
    assert not any(i.startswith("triton-cpu-bfloat16") for i in ids)


def test_the_suite_fails_a_wrong_op():
    import pytest

    from conformance.layer_ops_suite import _check
    from core.layers.ops_ref import TorchLayerOps

    class Wrong(TorchLayerOps):
        def silu_and_mul(self):  # gelu where silu belongs
            return lambda x: torch.nn.functional.gelu(x[:, :x.shape[1] // 2]) * \
                x[:, x.shape[1] // 2:]

        def qk_norm_rotary(self, head_dim, q_weight, k_weight, eps):  # k normed with q's weight
            return super().qk_norm_rotary(head_dim, q_weight, q_weight, eps)

        def store_kv(self):  # writes K into V's buffer too
            def store(k, v, loc, kb, vb):
                kb[loc], vb[loc] = k, k
                return True
            return store

        def rotary_mla(self, rope_dim, interleaved):  # the pairs left interleaved
            return super().rotary_mla(rope_dim, False)

        def gelu_and_mul(self, approximate):  # the other gelu form
            return super().gelu_and_mul("none" if approximate == "tanh" else "tanh")

        def norm_add_norm(self, weight1, weight2, eps):  # the two norms' weights swapped
            return super().norm_add_norm(weight2, weight1, eps)

    cpu = torch.device("cpu")
    for op in ("silu_and_mul", "store_kv", "qk_norm_rotary", "rotary_mla", "gelu_and_mul",
               "norm_add_norm"):
        with pytest.raises(AssertionError):
            _check(op, Wrong(), TorchLayerOps(), torch.float32, cpu)


def test_gated_gelu_runs_through_the_ops_gelu_and_mul():
    """Gemma's GeGLU (gelu_pytorch_tanh) and erf gelu go through the layer ops' fused op where
    they provide it, and through the reference's where they do not (cpu_c)."""
    from core.contract.layer_ops import WithReference
    from core.layers.activation import GatedAct
    from core.layers.ops_ref import TorchLayerOps

    seen = []

    class Counting:
        def gelu_and_mul(self, approximate):
            ref = TorchLayerOps().gelu_and_mul(approximate)

            def run(x):
                seen.append(approximate)
                return ref(x)
            return run

    x = torch.randn(3, 2 * 24) * 3
    for act, form in (("gelu_pytorch_tanh", "tanh"), ("gelu", "none")):
        gate, up = x.chunk(2, dim=-1)
        want = torch.nn.functional.gelu(gate, approximate=form) * up
        torch.testing.assert_close(GatedAct(act, WithReference(Counting(), TorchLayerOps()))(x),
                                   want)
        assert seen[-1] == form
        torch.testing.assert_close(GatedAct(act, WithReference(object(), TorchLayerOps()))(x),
                                   want)  # a plugin without the op: the reference's


def test_the_suite_fails_a_wrong_norm_add_norm():
    """Gemma's norm + add + norm: the residual returned before the add, the second norm over h
    instead of the sum, each norm's eps outside the square root (in turn)."""
    from functools import partial

    import pytest

    from conformance.layer_ops_suite import _check
    from core.layers.ops_ref import TorchLayerOps, add_rms_norm, rms_norm

    def before_add(h, residual, n1, add_n2):
        out, _ = add_n2(n1(h), residual)
        return out, residual

    def norm2_of_h(h, residual, n1, add_n2):
        out, total = add_n2(n1(h), residual)
        return add_n2.keywords["norm"](h), total

    def eps_outside(x, weight, eps):
        xf = x.float()
        return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)

    class Planted(TorchLayerOps):
        def __init__(self, fn=None, norm1=rms_norm, norm2=rms_norm):
            super().__init__()
            self.fn, self.norm1, self.norm2 = fn, norm1, norm2

        def norm_add_norm(self, weight1, weight2, eps):
            n1 = partial(self.norm1, weight=weight1, eps=eps)
            add_n2 = partial(add_rms_norm, norm=partial(self.norm2, weight=weight2, eps=eps))
            return partial(self.fn or (lambda h, r, n1, add_n2: add_n2(n1(h), r)), n1=n1,
                           add_n2=add_n2)

    cpu = torch.device("cpu")
    _check("norm_add_norm", Planted(), TorchLayerOps(), torch.float32, cpu)  # unplanted passes
    for dtype in (torch.float32, torch.bfloat16):
        for planted in (Planted(before_add), Planted(norm2_of_h), Planted(norm1=eps_outside),
                        Planted(norm2=eps_outside)):
            with pytest.raises(AssertionError):
                _check("norm_add_norm", planted, TorchLayerOps(dtype, cpu), dtype, cpu)


def test_norm_add_norm_binding_is_the_two_norms_one_after_the_other():
    """RMSNorm.bound_add_norm (Gemma's post-attention norm, residual add, pre-MLP norm): the
    same numbers as bound() then the next norm's bound_add(), through the ops' norm_add_norm;
    a plugin without the op keeps its own rms_norm and add_rms_norm (cpu_c); norms of two eps
    compose the two."""
    from core.contract.layer_ops import WithReference
    from core.layers.norm import RMSNorm
    from core.layers.ops_ref import TorchLayerOps

    calls = []

    class Counting:
        def rms_norm(self, weight, eps):
            ref = TorchLayerOps().rms_norm(weight, eps)

            def run(x):
                calls.append("rms_norm")
                return ref(x)
            return run

        def add_rms_norm(self, weight, eps):
            ref = TorchLayerOps().add_rms_norm(weight, eps)

            def run(x, residual):
                calls.append("add_rms_norm")
                return ref(x, residual)
            return run

    class Fused(Counting):
        def norm_add_norm(self, weight1, weight2, eps):
            ref = TorchLayerOps().norm_add_norm(weight1, weight2, eps)

            def run(h, residual):
                calls.append("norm_add_norm")
                return ref(h, residual)
            return run

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        h = (torch.randn(3, 40, generator=g) * 3).to(dtype)
        res = (torch.randn(3, 40, generator=g) * 8).to(dtype)
        for ops, want_calls in ((TorchLayerOps(), []), (WithReference(Fused(), TorchLayerOps()),
                                                        ["norm_add_norm"]),
                                (WithReference(Counting(), TorchLayerOps()),
                                 ["rms_norm", "add_rms_norm"])):
            n1, n2 = (RMSNorm(40, 1e-6, dtype, ops=ops) for _ in range(2))
            n1.weight.uniform_(0.5, 1.5, generator=g)
            n2.weight.uniform_(0.5, 1.5, generator=g)
            want = RMSNorm.forward(n2, n1.bound()(h), res)
            calls.clear()
            got = n1.bound_add_norm(n2)(h, res)
            assert calls == want_calls
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), (dtype, type(ops).__name__)
            n2.eps = 1e-5  # one eps per fused op: composed
            calls.clear()
            n1.bound_add_norm(n2)(h, res)
            assert "norm_add_norm" not in calls


def test_a_plugin_without_the_fused_qk_norm_keeps_its_own_norms():
    """qk_norm_rotary is optional (core.contract.layer_ops.OPTIONAL_OPS): a plugin without it (cpu_c, a
    third party's written before it) gets the reference's math over its own rms_norm."""
    from core.contract.layer_ops import WithReference, qk_norm_rotary
    from core.layers.ops_ref import TorchLayerOps

    calls = []

    class NormsOnly:
        def rms_norm(self, weight, eps):
            ref = TorchLayerOps().rms_norm(weight, eps)

            def norm(x):
                calls.append(x.shape)
                return ref(x)
            return norm

    d, hq, hk, t = 16, 3, 1, 2
    qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    ang = torch.rand(t, d // 2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([-ang.sin(), ang.sin()], -1)[:, None]
    want = TorchLayerOps().qk_norm_rotary(d, qw, kw, 1e-6)(qkv, cos, sin, hq, hk)
    for ops in (NormsOnly(), WithReference(NormsOnly(), TorchLayerOps())):
        calls.clear()
        got = qk_norm_rotary(ops, d, qw, kw, 1e-6)(qkv, cos, sin, hq, hk)
        assert len(calls) == 2  # the plugin's norm, once for q and once for k
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


# -- issue 32: blind spots of the suite ------------------------------------------------------------

def _eps_outside(x, weight, eps):
    xf = x.float()
    return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def _no_eps(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def test_the_suite_fails_eps_outside_the_square_root_and_no_eps():
    """Rows of ordinary norm cannot tell rsqrt(mean + eps) from 1 / (rms + eps) at eps 1e-6;
    the suite's all-zero and small-norm rows can (a planted bug passed it before)."""
    from functools import partial

    import pytest

    from conformance.layer_ops_suite import _check
    from core.layers.ops_ref import TorchLayerOps, compose_qk_norm_rotary

    def planted(norm):
        class Planted(TorchLayerOps):
            def rms_norm(self, weight, eps):
                return partial(norm, weight=weight, eps=eps)

            def qk_norm_rotary(self, head_dim, q_weight, k_weight, eps):
                return compose_qk_norm_rotary(self.rms_norm(q_weight, eps),
                                              self.rms_norm(k_weight, eps), head_dim)
        return Planted()

    cpu = torch.device("cpu")
    for norm in (_eps_outside, _no_eps):
        for dtype in (torch.float32, torch.bfloat16):
            for op in ("rms_norm", "add_rms_norm", "qk_norm_rotary"):
                with pytest.raises(AssertionError):
                    _check(op, planted(norm), TorchLayerOps(dtype, cpu), dtype, cpu)
    for op in ("rms_norm", "add_rms_norm", "qk_norm_rotary"):  # the reference itself passes
        _check(op, TorchLayerOps(), TorchLayerOps(), torch.float32, cpu)


def test_an_op_returning_none_is_a_skip_unless_declared():
    """An op that returns None for every input was reported PASSED: it is a skip with the
    reason when the plugin does not declare it (LayerOpsCaps.ops), a failure when it does."""
    import pytest
    from _pytest.outcomes import Skipped

    from conformance.layer_ops_suite import _check
    from core.contract.layer_ops import OPS
    from core.layers.ops_ref import TorchLayerOps

    class Nothing(TorchLayerOps):
        pass

    for op in OPS:
        setattr(Nothing, op, lambda self, *a, **k: None)
    cpu = torch.device("cpu")
    for op in OPS:
        with pytest.raises(Skipped, match=f"{op} not declared"):
            _check(op, Nothing(), TorchLayerOps(), torch.float32, cpu, declared=frozenset())
        with pytest.raises(AssertionError, match=f"{op} is declared"):
            _check(op, Nothing(), TorchLayerOps(), torch.float32, cpu, declared=frozenset(OPS))
