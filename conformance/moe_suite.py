"""The MoE-runner conformance tests.

Collected by the conformance plugin (`pytest --conformance-moe NAME`, see the conformance
package), or by importing them into a test module:

    from conformance.moe_suite import *  # noqa: F401,F403

Parametrization: every registered MoE runner that can run on each suite device, or only those
named with --conformance-moe; devices from --conformance-device, else cpu plus cuda when present
(non-CPU cases carry the `gpu` mark). A Triton runner runs on CPU under TRITON_INTERPRET=1 (not
in bf16). Cases are cut to the runner's declared capabilities (conformance.moe_cases); for a
runner named with --conformance-moe, what it does not declare is listed as one skipped test per
item, `...-not-covered-<what>`, with the reason (`pytest -rs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conformance.attention_check import excluded_dtype_reasons
from conformance.moe_cases import MoECase, conformance_cases, not_covered
from conformance.moe_check import check_case, check_graph_case
from conformance.suite_kit import Target, skip_param, suite_params
from core.plan.registry import Registration

__all__ = ["pytest_generate_tests", "test_moe_runner_conformance",
           "test_moe_runner_graph_capture"]

_GRAPH_MAX_TOKENS = 16  # decode-sized cases get the graph check


@dataclass(frozen=True)
class MoEConformanceParam:
    runner: Registration
    device: str
    case: MoECase
    seed: int


def moe_conformance_params(config: pytest.Config, graph: bool = False) -> list:
    """pytest.param objects for every (runner, device, case) the options select; with
    `graph`, the CUDA-graph cases instead."""

    def cases(t: Target) -> list:
        if graph and (not t.reg.caps.cuda_graph or t.device.type != "cuda"):
            return []
        excluded = excluded_dtype_reasons(t.reg, t.device)
        chosen = conformance_cases(t.reg.caps, t.full, tuple(excluded))
        if graph:
            chosen = [c for c in chosen if c.tokens <= _GRAPH_MAX_TOKENS]
        params = [pytest.param(MoEConformanceParam(t.reg, t.device_name, case, t.seed),
                               id=f"{t.name}-{t.device_name}-{case.id}", marks=t.marks)
                  for case in chosen]
        if t.named and not graph:  # asked for by name: say what is not tested, and why
            params += [skip_param(f"{t.name}-{t.device_name}-not-covered-{key}",
                                  f"{t.name}: {reason}", t.marks)
                       for key, reason in not_covered(t.reg.caps, excluded)]
        return params

    params = suite_params(config, "moe", "conformance_moe", "MoE runner", cases)
    if graph and not params:
        params.append(pytest.param(None, id="no-graph-cases", marks=pytest.mark.skip(
            reason="no selected MoE runner declares cuda_graph on a selected CUDA device")))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "moe_conformance" in metafunc.fixturenames:
        metafunc.parametrize("moe_conformance", moe_conformance_params(metafunc.config))
    if "moe_graph_conformance" in metafunc.fixturenames:
        metafunc.parametrize("moe_graph_conformance",
                             moe_conformance_params(metafunc.config, graph=True))


def test_moe_runner_conformance(moe_conformance: MoEConformanceParam) -> None:
    """The runner's output (into a poisoned `out`, and without one) matches the fp32
    reference; its inputs are left as they were (see conformance.moe_check)."""
    p = moe_conformance
    check_case(p.runner, p.case, torch.device(p.device), p.seed)


def test_moe_runner_graph_capture(moe_graph_conformance: MoEConformanceParam) -> None:
    """A runner declaring cuda_graph: a decode-sized call captured once replays correctly on
    new hidden states, logits and shared outputs."""
    p = moe_graph_conformance
    check_graph_case(p.runner, p.case, torch.device(p.device), p.seed)
