"""The MoE-runner conformance suite over the built-in runners, and the runners' own pieces.

On a CPU machine: torch_native, and triton under TRITON_INTERPRET=1 (fp16/fp32: the interpreter
gets bf16 wrong), small shapes. On a GPU machine, `pytest -m gpu tests/test_moe_conformance.py
--conformance-full` runs the cuda cases at full size (and the CUDA-graph replay check). The suite
itself lives in conformance/ (shipped for third-party runners: `pytest --conformance-moe NAME`).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Before any Triton kernel module is imported (the runner factory imports them lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.moe_suite import *  # noqa: E402,F401,F403
from conformance.moe_suite import moe_conformance_params  # noqa: E402
from core.plan.registry import get_registry  # noqa: E402

BUILTIN = ("torch_native", "triton")
INTERPRETED = (os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
               and importlib.util.find_spec("triton") is not None)


def test_builtin_runners_are_registered():
    registered = set(get_registry().kind("moe"))
    missing = [n for n in BUILTIN if n not in registered]
    assert not missing, (f"MoE runners {missing} not registered: reinstall core-serve "
                         f"(pip install --no-deps -e .) so its entry points are current")


def test_suite_covers_every_builtin_runner_on_cpu(request):
    """Each built-in runner gets the matrix on CPU: top-k 1/2/4/8, experts 8 to 256, both
    scorings, grouped top-k, shared experts, renormalize on and off, every routing kind,
    noaux_tc's correction bias."""
    if request.config.getoption("conformance_moe", default=None):
        pytest.skip("--conformance-moe narrows the suite on purpose")
    params = [p.values[0] for p in moe_conformance_params(request.config)
              if p.values[0] is not None and p.values[0].device == "cpu"]
    for name in BUILTIN if INTERPRETED else ("torch_native",):
        cases = [p.case for p in params if p.runner.name == name]
        assert {c.top_k for c in cases} == {1, 2, 4, 8}, name
        assert {c.experts for c in cases} == {8, 16, 60, 64, 128, 256}, name
        assert {c.scoring for c in cases} == {"softmax", "sigmoid"}, name
        assert {c.routing for c in cases} == {"random", "one_expert", "few_experts"}, name
        assert {c.renormalize for c in cases} == {True, False}, name
        assert any(c.groups for c in cases) and any(c.shared for c in cases), name
        assert {c.scaling for c in cases} >= {1.0, 2.5, 0.5}, name  # routed_scaling_factor
        # noaux_tc (issue 34): with and without groups, V3's routing shape among them
        bias = [c for c in cases if c.correction_bias]
        assert any(c.groups for c in bias) and any(not c.groups for c in bias), name
        assert any((c.experts, c.top_k, c.groups, c.scaling) == (256, 8, (8, 4), 2.5)
                   and c.shared for c in bias), name
    if INTERPRETED:
        assert {p.case.dtype for p in params if p.runner.name == "triton"} == \
            {"float16", "float32"}


# -- planted bugs the suite must catch (issue 32: one ignoring routed_scaling_factor passed) ------

def _planted(runner_cls):
    import types

    return types.SimpleNamespace(name=runner_cls.__name__, load=lambda: runner_cls)


def _small_failures(reg, cases):
    from conformance.moe_check import check_case

    failed = set()
    for case in cases:
        try:
            check_case(reg, case, torch.device("cpu"))
        except AssertionError:
            failed.add(case.id)
    return failed


def test_the_suite_fails_a_runner_that_ignores_routed_scaling_factor():
    import dataclasses

    from conformance.moe_cases import all_cases
    from plugins.moe.torch_native.runner import TorchNativeMoE

    class IgnoresScaling(TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            layer = dataclasses.replace(layer, routed_scaling_factor=1.0)
            return super().forward(hidden, router_logits, weights, layer, shared, out)

    class ScalesShared(TorchNativeMoE):
        """Scales the shared experts' output too (only the routed weights are scaled)."""

        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            if shared is not None:
                shared = shared * layer.routed_scaling_factor
            return super().forward(hidden, router_logits, weights, layer, shared, out)

    cases = [c for c in all_cases() if c.activation == "silu"]
    scaled = {c.id for c in cases if c.scaling != 1.0}
    assert len(scaled) >= 4 and {c.scaling for c in cases} >= {1.0, 2.5, 0.5}
    assert any(c.ep > 1 for c in cases if c.scaling != 1.0)
    assert _small_failures(_planted(IgnoresScaling), cases) == scaled
    shared_scaled = {c.id for c in cases if c.scaling != 1.0 and c.shared}
    assert shared_scaled and _small_failures(_planted(ScalesShared), cases) == shared_scaled
    assert _small_failures(_planted(TorchNativeMoE), cases) == set()


def test_the_suite_fails_a_runner_whose_gelu_is_the_tanh_approximation():
    import torch.nn.functional as F

    from conformance.moe_cases import all_cases
    from plugins.moe.torch_native import runner as native

    def tanh_gelu(gate_up, layer):
        if layer.activation != "gelu":
            return native_act(gate_up, layer)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    native_act = native.gated_activation
    gelu = [c for c in all_cases() if c.activation == "gelu"]
    assert gelu and _small_failures(_patched_act(tanh_gelu), gelu) == {c.id for c in gelu}


def _patched_act(fn):
    """torch_native with its gated activation replaced by fn(gate_up, layer)."""
    from plugins.moe.torch_native import runner as native

    class Patched(native.TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            real = native.gated_activation
            native.gated_activation = fn
            try:
                return super().forward(hidden, router_logits, weights, layer, shared, out)
            finally:
                native.gated_activation = real

    return _planted(Patched)


# -- DeepSeek-V3's noaux_tc: the correction bias (issue 34) --------------------------------------

def _noaux_tc_cases():
    from conformance.moe_cases import all_cases

    cases = [c for c in all_cases() if c.correction_bias]
    assert any(c.groups for c in cases) and any(c.groups is None for c in cases)
    assert any(c.ep > 1 for c in cases) and any(c.experts == 256 for c in cases)
    return cases


def _planted_route(fn):
    """torch_native with its routing replaced by fn(router_logits, layer)."""
    from plugins.moe.torch_native import runner as native

    class Patched(native.TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            real = native.route
            native.route = fn
            try:
                return super().forward(hidden, router_logits, weights, layer, shared, out)
            finally:
                native.route = real

    return _planted(Patched)


def test_the_suite_fails_a_runner_that_ignores_the_correction_bias():
    import dataclasses

    from plugins.moe.torch_native.runner import TorchNativeMoE

    class IgnoresBias(TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            layer = dataclasses.replace(layer, correction_bias=None)
            return super().forward(hidden, router_logits, weights, layer, shared, out)

    cases = _noaux_tc_cases()
    every = {c.id for c in cases}
    assert _small_failures(_planted(IgnoresBias), cases) == every
    assert _small_failures(_planted(TorchNativeMoE), cases) == set()


def test_the_suite_fails_noaux_tc_weights_or_groups_done_wrong():
    """Weights taken from the biased scores fail every noaux_tc case; groups ranked by their
    best biased score (not the top-2 sum) fail every grouped one."""
    from core.contract.moe import expert_scores, renormalized, route

    def biased_weights(logits, layer):
        _, ids = route(logits, layer)
        choice = expert_scores(logits, layer.scoring_func) + layer.correction_bias.float()
        w = choice.gather(1, ids)
        return (renormalized(w) if layer.renormalize else w) * layer.routed_scaling_factor, ids

    def groups_by_max(logits, layer):
        if layer.grouped_topk is None:
            return route(logits, layer)
        scores = expert_scores(logits, layer.scoring_func)
        choice = scores + layer.correction_bias.float()
        T, E = choice.shape
        g, keep = layer.grouped_topk
        best = choice.view(T, g, E // g).amax(-1).topk(keep, -1).indices  # [T, keep]
        kept = torch.zeros(T, g, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // g, 1), float("-inf"))
        ids = choice.topk(layer.top_k, -1).indices
        w = scores.gather(1, ids)
        return (renormalized(w) if layer.renormalize else w) * layer.routed_scaling_factor, ids

    cases = _noaux_tc_cases()
    assert _small_failures(_planted_route(biased_weights), cases) == {c.id for c in cases}
    grouped = {c.id for c in cases if c.groups}
    assert _small_failures(_planted_route(groups_by_max), cases) == grouped


def test_noaux_tc_reference_routing_is_select_experts():
    """The suite's token-by-token noaux_tc routing (conformance.moe_check) and the contract's
    select_experts agree on every case (the same experts, the same weights)."""
    from conformance.moe_check import build_inputs, reference_routing
    from core.contract.moe import route

    for case in _noaux_tc_cases():
        inputs = build_inputs(case, torch.device("cpu"), case.seed())
        want_w, want_ids = route(inputs.logits, inputs.layer)
        got_w, got_ids = reference_routing(inputs.logits, inputs.layer)
        assert torch.equal(got_ids, want_ids), case.id
        torch.testing.assert_close(got_w, want_w, msg=case.id)


def test_a_runner_without_correction_bias_is_told_why():
    """A runner whose caps lack correction_bias gets no noaux_tc case, and the named listing
    says so."""
    import dataclasses

    from conformance.moe_cases import conformance_cases, not_covered
    from plugins.moe.torch_native import CAPS

    caps = dataclasses.replace(CAPS, correction_bias=False)
    assert not any(c.correction_bias for c in conformance_cases(caps))
    assert any(c.correction_bias for c in conformance_cases(CAPS))
    assert "correction-bias" in dict(not_covered(caps))
    assert "correction-bias" not in dict(not_covered(CAPS))


# -- GPT-OSS's experts: the clamped SwiGLU and the expert biases ---------------------------------

def _gpt_oss_cases():
    from conformance.moe_cases import all_cases

    cases = [c for c in all_cases() if c.activation == "swigluoai" or c.bias]
    assert {c.swiglu_limit for c in cases if c.activation == "swigluoai"} == {7.0, 0.75}
    assert any(c.bias and c.activation == "silu" for c in cases)
    assert any(c.bias and c.ep > 1 for c in cases)
    return cases


def test_the_suite_fails_a_swigluoai_without_its_clamp_or_its_plus_one():
    from core.contract.moe import gated_activation

    def unclamped(gate_up, layer):  # SwiGLU-OAI as if the limit were infinite
        if layer.activation != "swigluoai":
            return gated_activation(gate_up, layer)
        gate, up = gate_up.chunk(2, dim=-1)
        return (up + 1) * gate * torch.sigmoid(layer.swiglu_alpha * gate)

    def plain_swiglu(gate_up, layer):  # up, not up + 1; alpha 1 (SiLU)
        if layer.activation != "swigluoai":
            return gated_activation(gate_up, layer)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    cases = [c for c in _gpt_oss_cases() if c.activation == "swigluoai"]
    clamped = {c.id for c in cases if c.swiglu_limit < 1}
    assert clamped and _small_failures(_patched_act(unclamped), cases) == clamped
    assert _small_failures(_patched_act(plain_swiglu), cases) == {c.id for c in cases}


def test_the_suite_fails_a_runner_that_drops_expert_biases():
    import dataclasses

    from plugins.moe.torch_native.runner import TorchNativeMoE

    class NoDownBias(TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            if "w2_bias" in weights.extra:
                weights = dataclasses.replace(weights, extra={
                    **weights.extra, "w2_bias": torch.zeros_like(weights.extra["w2_bias"])})
            return super().forward(hidden, router_logits, weights, layer, shared, out)

    class NoBiases(TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            return super().forward(hidden, router_logits, dataclasses.replace(weights, extra={}),
                                   layer, shared, out)

    cases = _gpt_oss_cases()
    biased = {c.id for c in cases if c.bias}
    assert _small_failures(_planted(NoDownBias), cases) == biased
    assert _small_failures(_planted(NoBiases), cases) == biased
    assert _small_failures(_planted(TorchNativeMoE), cases) == set()


def test_torch_native_swigluoai_is_transformers_gpt_oss_experts():
    """core.contract.moe.gated_activation and the runner's expert math against transformers'
    own GptOssExperts (interleaved gate/up columns, [E, H, 2I] / [E, I, H] layout)."""
    import transformers

    from core.contract.moe import MoELayerParams, MoEWeights
    from plugins.moe.torch_native.runner import TorchNativeMoE

    cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=3,
                                    num_experts_per_tok=2, swiglu_limit=1.5)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(5, 16, generator=g)
    logits = torch.randn(5, 3, generator=g)
    top, ids = logits.topk(2, dim=-1)
    with torch.no_grad():  # GptOssTopKRouter: a softmax over the k best logits
        want = experts(x, ids, torch.softmax(top, dim=-1))
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat((gu[:, :, 0::2], gu[:, :, 1::2]), dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat((gub[:, 0::2], gub[:, 1::2]), dim=1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()
    layer = MoELayerParams(layer_id=0, num_experts=3, top_k=2, hidden_size=16,
                           intermediate_size=12, renormalize=True, activation="swigluoai",
                           swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=1.5)
    got = TorchNativeMoE().forward(x, logits, MoEWeights(w13, w2, extra={
        "w13_bias": b13, "w2_bias": experts.down_proj_bias.detach()}), layer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
