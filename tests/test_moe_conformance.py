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
    """Each built-in runner gets the matrix on CPU: top-k 1/2/4/8, experts 8/60/64/128, both
    scorings, grouped top-k, shared experts, renormalize on and off, every routing kind."""
    if request.config.getoption("conformance_moe", default=None):
        pytest.skip("--conformance-moe narrows the suite on purpose")
    params = [p.values[0] for p in moe_conformance_params(request.config)
              if p.values[0] is not None and p.values[0].device == "cpu"]
    for name in BUILTIN if INTERPRETED else ("torch_native",):
        cases = [p.case for p in params if p.runner.name == name]
        assert {c.top_k for c in cases} == {1, 2, 4, 8}, name
        assert {c.experts for c in cases} == {8, 60, 64, 128}, name
        assert {c.scoring for c in cases} == {"softmax", "sigmoid"}, name
        assert {c.routing for c in cases} == {"random", "one_expert", "few_experts"}, name
        assert {c.renormalize for c in cases} == {True, False}, name
        assert any(c.groups for c in cases) and any(c.shared for c in cases), name
        assert {c.scaling for c in cases} >= {1.0, 2.5, 0.5}, name  # routed_scaling_factor
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

    class TanhGelu(native.TorchNativeMoE):
        def forward(self, hidden, router_logits, weights, layer, shared=None, out=None):
            real = native.get_act_fn
            native.get_act_fn = lambda name: (lambda x: F.gelu(x, approximate="tanh")) \
                if name == "gelu" else real(name)
            try:
                return super().forward(hidden, router_logits, weights, layer, shared, out)
            finally:
                native.get_act_fn = real

    gelu = [c for c in all_cases() if c.activation == "gelu"]
    assert gelu and _small_failures(_planted(TanhGelu), gelu) == {c.id for c in gelu}
