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
from conformance.attention_check import (
    REFERENCE,
    check_case,
    device_target,
    excluded_dtype_reasons,
    unavailable_reasons,
)
from conformance.paged_batch import AttentionCase
from conformance.plugin import named_plugins  # noqa: F401 - shared by every suite
from core.contract.capabilities import DeviceInfo
from core.plan.registry import Registration

__all__ = ["pytest_generate_tests", "test_attention_backend_conformance"]


@dataclass(frozen=True)
class ConformanceParam:
    """One parametrized run: a backend, a device, a case."""

    backend: Registration
    device: str
    case: AttentionCase
    seed: int
    reference: Registration | None


def default_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _device_info(registry, device: torch.device) -> DeviceInfo:
    target = device_target(device)
    if target in registry.kind("hardware"):
        return registry.probe(target)
    return DeviceInfo(target=target, device_type=device.type)


def _device_missing(device: torch.device) -> str:
    """Why tensors cannot be made on `device` ("" when they can)."""
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch raises either for absent devices
        return str(exc).splitlines()[0]
    return ""


def conformance_params(config: pytest.Config) -> list:
    """pytest.param objects for every (backend, device, case) the options select."""
    registry, backends, named = named_plugins(config, "attention", "conformance_backend",
                                              "attention backend")
    devices = config.getoption("conformance_device", default=None) or default_devices()
    full = bool(config.getoption("conformance_full", default=False))
    seed = int(config.getoption("conformance_seed", default=0) or 0)
    reference = backends.get(REFERENCE)
    params = []
    for device_name in devices:
        device = torch.device(device_name)
        marks = [] if device.type == "cpu" else [pytest.mark.gpu]
        missing = _device_missing(device)
        if missing:
            params.append(pytest.param(None, id=f"{device_name}-unavailable", marks=[
                *marks, pytest.mark.skip(reason=f"device {device_name}: {missing}")]))
            continue
        info = _device_info(registry, device)
        for name in named or sorted(backends):
            reg = backends[name]
            reasons = unavailable_reasons(reg, device, info)
            if reasons:
                if name in named:  # asked for by name: say why it does not run
                    params.append(pytest.param(
                        None, id=f"{name}-{device_name}",
                        marks=[*marks, pytest.mark.skip(
                            reason=f"{name} cannot run on {device_name}: {'; '.join(reasons)}")]))
                continue
            excluded = excluded_dtype_reasons(reg, device)
            for case in conformance_cases(reg.caps, full, tuple(excluded)):
                params.append(pytest.param(
                    ConformanceParam(reg, device_name, case, seed, reference),
                    id=f"{name}-{device_name}-{case.id}", marks=marks))
            if name in named:  # asked for by name: say what is not tested, and why
                for key, reason in not_covered(reg.caps, excluded):
                    params.append(pytest.param(
                        None, id=f"{name}-{device_name}-not-covered-{key}",
                        marks=[*marks, pytest.mark.skip(reason=f"{name}: {reason}")]))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attention_conformance" in metafunc.fixturenames:
        metafunc.parametrize("attention_conformance", conformance_params(metafunc.config))


def test_attention_backend_conformance(attention_conformance: ConformanceParam) -> None:
    """The backend's output, KV write and untouched pool match the fp32 reference and
    torch_native on this case (see conformance.attention_check for every check)."""
    p = attention_conformance
    check_case(p.backend, p.case, torch.device(p.device), p.seed, p.reference)
