"""The attention-backend conformance tests.

Collected by the conformance plugin (`pytest --conformance-backend NAME`, see the conformance
package), or by importing them into a test module:

    from conformance.attention_suite import *  # noqa: F401,F403

Parametrization (by `pytest_generate_tests` below): every registered attention backend that can
run on each suite device, or only the backends named with --conformance-backend; devices from
--conformance-device, else cpu plus cuda when present. Cases on a device other than the CPU carry
the `gpu` mark (select them with `-m gpu`). A Triton backend runs on CPU under TRITON_INTERPRET=1.
Cases are cut to the backend's declared capabilities; for a backend named with
--conformance-backend, what it does not declare (page sizes, dtypes, features) is listed as one
skipped test per item, `...-not-covered-<what>`, with the reason (`pytest -rs` prints them).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conformance.attention_cases import conformance_cases, not_covered
from conformance.attention_check import REFERENCE, check_case, excluded_dtype_reasons
from conformance.paged_batch import AttentionCase
from conformance.plugin import named_plugins  # noqa: F401 - shared by every suite
from conformance.suite_kit import (
    Target,
    default_devices,  # noqa: F401 - its old home
    skip_param,
    suite_params,
)
from conformance.suite_kit import device_info as _device_info  # noqa: F401 - its old name
from conformance.suite_kit import device_missing as _device_missing  # noqa: F401 - old name
from core.plan.registry import Registration, get_registry

__all__ = ["pytest_generate_tests", "test_attention_backend_conformance"]


@dataclass(frozen=True)
class ConformanceParam:
    """One parametrized run: a backend, a device, a case."""

    backend: Registration
    device: str
    case: AttentionCase
    seed: int
    reference: Registration | None


def conformance_params(config: pytest.Config) -> list:
    """pytest.param objects for every (backend, device, case) the options select."""
    reference = get_registry().kind("attention").get(REFERENCE)

    def cases(t: Target) -> list:
        excluded = excluded_dtype_reasons(t.reg, t.device)
        params = [pytest.param(ConformanceParam(t.reg, t.device_name, case, t.seed, reference),
                               id=f"{t.name}-{t.device_name}-{case.id}", marks=t.marks)
                  for case in conformance_cases(t.reg.caps, t.full, tuple(excluded))]
        if t.named:  # asked for by name: say what is not tested, and why
            params += [skip_param(f"{t.name}-{t.device_name}-not-covered-{key}",
                                  f"{t.name}: {reason}", t.marks)
                       for key, reason in not_covered(t.reg.caps, excluded)]
        return params

    return suite_params(config, "attention", "conformance_backend", "attention backend", cases)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attention_conformance" in metafunc.fixturenames:
        metafunc.parametrize("attention_conformance", conformance_params(metafunc.config))


def test_attention_backend_conformance(attention_conformance: ConformanceParam) -> None:
    """The backend's output, KV write and untouched pool match the fp32 reference and
    torch_native on this case (see conformance.attention_check for every check)."""
    p = attention_conformance
    check_case(p.backend, p.case, torch.device(p.device), p.seed, p.reference)
