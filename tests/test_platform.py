"""The Platform contract (core/contract/platform.py): every built-in hardware target registers one that
has every method; a target without one runs on GenericPlatform; the register callback refuses a
platform where it does not belong."""

from __future__ import annotations

import pytest
import torch

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl
from core.contract.platform import GenericPlatform, GraphSupport, Platform, load_platform
from core.plan.devices import PROFILES, select_device
from core.plan.registry import build_registry

METHODS = ("torch_device", "memory", "memory_defaults", "to_device", "copy_to_host",
           "synchronize", "graphs", "graph_runner", "post_load", "overlap_schedule",
           "warmup_shapes", "dist_backend")


@pytest.mark.parametrize("target,profile", [("cuda", "h200"), ("rocm", "mi300x"),
                                            ("xpu", "intel-max-1550"), ("npu", "ascend-910b"),
                                            ("cpu", "xeon-amx")])
def test_every_built_in_target_registers_a_whole_platform(target, profile):
    registry = build_registry()
    info = PROFILES[profile]
    assert info.target == target
    platform = load_platform(registry, info)  # built without touching the device
    assert not isinstance(platform, GenericPlatform)
    assert isinstance(platform, Platform) and all(hasattr(platform, m) for m in METHODS)
    assert isinstance(platform.graphs(), GraphSupport)
    assert platform.graphs().available == (target in ("cuda", "rocm"))
    if not platform.graphs().available:
        assert platform.graphs().reason  # off, and says why
    # graph ability has one source: the profile (and select_device) say what the Platform says
    assert info.graph_capture == platform.graphs().available
    assert select_device(registry, profile=profile).graph_capture == info.graph_capture
    on, why = platform.overlap_schedule()
    assert on == (target in ("cuda", "rocm")) and why
    assert platform.dist_backend() == info.dist_backend


def test_the_cpu_platform_runs_here():
    from plugins.hardware import cpu

    platform = load_platform(build_registry(), cpu.probe())
    free, total = platform.memory(0)
    assert 0 < free <= total
    t = torch.arange(4)
    assert platform.to_device(t, torch.device("cpu")) is t
    host, waiter = platform.copy_to_host(t)
    assert waiter is None and torch.equal(host, t)


class _NoPlatformTarget:
    CORE_PLUGIN_API = ">=1.0,<2"

    @staticmethod
    @hookimpl
    def core_register_hardware(register):
        register("bare_accel", HardwareCaps(device_type="cpu"),
                 lambda: DeviceInfo(target="bare_accel", device_type="cpu", memory_bytes=2**30))


def test_a_target_without_a_platform_runs_generic_and_says_so():
    registry = build_registry(extra=[("bare", _NoPlatformTarget())], entry_points=False)
    info = registry.probe("bare_accel")
    platform = load_platform(registry, info)
    assert isinstance(platform, GenericPlatform)
    assert "registers no Platform" in platform.graphs().reason
    assert "registers no Platform" in platform.memory_defaults(2**30, None).note
    assert platform.overlap_schedule()[0] is False


def test_graph_capture_comes_from_the_platform_not_the_profile(monkeypatch):
    from plugins.hardware.gpu import TorchCudaPlatform

    assert PROFILES["h100"].graph_capture is True
    assert select_device(build_registry(), "cpu").graph_capture is False
    monkeypatch.setattr(TorchCudaPlatform, "graphs", lambda self: GraphSupport(False, "no"))
    assert select_device(build_registry(), profile="h100").graph_capture is False
    # a target that registers no Platform has no graphs, whatever its profile says
    bare = build_registry(extra=[("bare", _NoPlatformTarget())], entry_points=False)
    assert select_device(bare, profile="h100").graph_capture is False


class _Misplaced:
    @staticmethod
    @hookimpl
    def core_register_layer_ops(register):
        from core.contract.capabilities import LayerOpsCaps

        register("odd", LayerOpsCaps(devices={"cpu"}), "x:y", platform="a:b")


class _BadPlatform:
    @staticmethod
    @hookimpl
    def core_register_hardware(register):
        register("bad_accel", HardwareCaps(device_type="cpu"), "x:probe", platform=42)


@pytest.mark.parametrize("plugin,match", [(_Misplaced(), "only hardware targets register a "
                                                         "platform"),
                                          (_BadPlatform(), "platform must be callable")])
def test_register_refuses_a_misplaced_or_malformed_platform(plugin, match):
    registry = build_registry(extra=[("p", plugin)], entry_points=False)
    assert [f.stage for f in registry.failures] == ["register"]
    assert match in registry.failures[0].error


def test_fp8_kv_on_an_a100_is_refused_before_anything_is_built(model_spec):
    """Conditional capability: the triton backend reads FP8 caches on sm89+ only; the resolver
    knows it (a reason in the plan), no factory fails after the plan was printed."""
    from core.plan.args import ServerArgs
    from core.plan.plan import ResolveError
    from core.plan.resolver import resolve

    spec = model_spec("llama-3.1-8b")
    registry = build_registry()
    with pytest.raises(ResolveError) as e:
        resolve(spec, PROFILES["a100"], ServerArgs(attention_backend="triton",
                                                   kv_cache_dtype="fp8_e4m3"), registry)
    assert any("fp8_e4m3 KV cache needs device feature fp8" in r for r in e.value.reasons)
    plan = resolve(spec, PROFILES["h100"], ServerArgs(attention_backend="triton",
                                                      kv_cache_dtype="fp8_e4m3"), registry)
    assert plan.kv_cache_dtype == "fp8_e4m3"


# The shipped Platform conformance suite over every target available here (the cpu on CI).
from conformance.platform_suite import *  # noqa: E402,F401,F403
from conformance.platform_suite import platform_params  # noqa: E402


def test_the_platform_suite_covers_the_cpu(pytestconfig):
    ids = {p.id for p in platform_params(pytestconfig)}
    assert {f"cpu-{c}" for c in ("memory", "defaults", "copies", "graphs", "overlap",
                                 "post_load")} <= ids


def test_the_platform_suite_fails_a_platform_that_changes_the_model(monkeypatch):
    from conformance import platform_suite
    from plugins.hardware.cpu_runtime import CpuPlatform

    def corrupting(self, model):
        for p in model.parameters():
            p.data.mul_(1.01)
        return []

    monkeypatch.setattr(CpuPlatform, "post_load", corrupting)
    with pytest.raises(AssertionError):
        platform_suite.test_platform_conformance("cpu", "post_load")
    monkeypatch.setattr(CpuPlatform, "graphs", lambda self: GraphSupport(False, " "))
    with pytest.raises(AssertionError, match="must say why"):
        platform_suite.test_platform_conformance("cpu", "graphs")
