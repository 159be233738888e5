"""The Platform contract (core/contract/platform.py): BasePlatform's every member is real, with a
default and a docstring; every built-in hardware target registers a subclass that overrides only
members of it; a target without one runs on GenericPlatform; the register callback refuses
anything but a BasePlatform subclass (or a factory of one) when the plugin loads, and `core
backends` lists why; nothing in the core probes a platform for members."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

from core.contract.capabilities import DeviceInfo, HardwareCaps, c_compiler
from core.contract.hookspecs import hookimpl
from core.contract.platform import (
    BasePlatform,
    GenericPlatform,
    GraphSupport,
    MemoryDefaults,
    Platform,
    load_platform,
)
from core.plan import registry as plugins
from core.plan.devices import PROFILES, select_device
from core.plan.registry import build_registry

ROOT = Path(__file__).resolve().parent.parent
# BasePlatform's members: what the engine may call on any platform (and nothing else)
MEMBERS = ("torch_device", "host_device", "memory", "memory_defaults", "zeros", "to_device",
           "copy_to_host", "synchronize", "graphs", "graph_runner", "post_load",
           "overlap_schedule", "warmup_shapes", "dist_backend", "dist_bind", "dist_device")


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_base_platform_members_are_real_defaults_with_docstrings():
    assert Platform is BasePlatform  # one class; `Platform` is the name annotations use
    assert set(MEMBERS) == _public_methods(BasePlatform)
    for name in MEMBERS:
        method = getattr(BasePlatform, name)
        assert (method.__doc__ or "").strip(), f"BasePlatform.{name} has no docstring"
        body = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0].body[1:]
        stub = len(body) == 1 and isinstance(body[0], (ast.Pass, ast.Expr))  # `...`, `pass`
        assert body and not stub and "NotImplementedError" not in ast.dump(body[-1]), name
    # the defaults answer on a target that registers no Platform (a host-type one here)
    p = GenericPlatform(DeviceInfo(target="bare", device_type="cpu", memory_bytes=2**30,
                                   dist_backend="gloo"))
    assert (p.torch_device(0), p.host_device(), p.dist_backend()) == ("cpu", "cpu", "gloo")
    assert p.dist_bind(torch.device("cpu")) == {}
    assert p.dist_device(torch.device("cpu")) == torch.device("cpu")
    assert isinstance(p.memory_defaults(2**30, None), MemoryDefaults)
    assert p.warmup_shapes() == [] and p.post_load(torch.nn.Linear(2, 2)) == []
    buf = p.zeros((4, 2), torch.bfloat16, torch.device("cpu"))
    assert buf.dtype == torch.bfloat16 and not buf.any()
    t = torch.arange(3)
    assert torch.equal(p.to_device(t, torch.device("cpu")), t)
    assert p.copy_to_host(t)[1] is None and p.synchronize(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="torch.cpu.mem_get_info"):
        p.memory(0)  # the host has no torch.cpu.mem_get_info: the reason says what to override
    with pytest.raises(RuntimeError, match="graphs\\(\\).available"):
        p.graph_runner(None, [1], 8)
    gpu = GenericPlatform(DeviceInfo(target="bare", device_type="cuda", dist_backend="nccl"))
    assert gpu.torch_device(1) == "cuda:1"
    assert gpu.dist_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


@pytest.mark.parametrize("cls", ["plugins.hardware.gpu:TorchCudaPlatform",
                                 "plugins.hardware.accel:XpuPlatform",
                                 "plugins.hardware.accel:NpuPlatform",
                                 "plugins.hardware.cpu_runtime:CpuPlatform"])
def test_built_in_platforms_override_only_members_of_the_base(cls):
    """A subclass adds no public method the engine would have to know of (it could only find
    one by probing)."""
    klass = plugins.load_ref(cls)
    assert issubclass(klass, BasePlatform)
    extra = set().union(*(_public_methods(c) for c in klass.__mro__[:-1])) - set(MEMBERS)
    assert not extra, extra


def test_nothing_probes_a_platform_for_members():
    probe = re.compile(r"\b(hasattr|getattr)\(\s*[\w.]*platform\b|"
                       r"\bgetattr\([^)]*[\"']platform[\"']")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for folder in ("core", "conformance", "plugins/hardware")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if probe.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("target,profile", [("cuda", "h200"), ("rocm", "mi300x"),
                                            ("xpu", "intel-max-1550"), ("npu", "ascend-910b"),
                                            ("cpu", "xeon-amx")])
def test_every_built_in_target_registers_a_whole_platform(target, profile):
    registry = build_registry()
    info = PROFILES[profile]
    assert info.target == target
    platform = load_platform(registry, info)  # built without touching the device
    assert isinstance(platform, BasePlatform) and not isinstance(platform, GenericPlatform)
    assert type(platform) is registry.get("hardware", target).platform  # resolved at register
    assert isinstance(platform.graphs(), GraphSupport)
    # CPUs replay graphs of recorded C calls through a compiled trampoline (cpu_graphs.py)
    want = target in ("cuda", "rocm") or (target == "cpu" and c_compiler() is not None)
    assert platform.graphs().available == want
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
    assert platform.dist_bind(torch.device("cpu")) == {}  # gloo binds no device
    assert platform.dist_device(torch.device("cpu")) == torch.device("cpu")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_the_cpu_kv_pool_costs_no_memory_until_touched():
    """The cpu platform's zeros come from calloc: a KV pool built for the host (its platform
    looked up from the device, as in-process tools do) is not resident until its slots are
    written. (BasePlatform's default, torch.zeros, writes every byte; its resident size is not
    asserted: after the pool is freed the allocator may hand the same, already resident pages
    back, which made that check depend on what ran before.)"""
    from core.engine.memory.kv_cache import KVPool

    size = 256 * 2**20
    before = _rss()
    pool = KVPool(size // (2 * 8 * 64 * 2), 1, 8, 64, torch.bfloat16, "cpu")  # K + V: 256 MiB
    assert _rss() - before < size // 4
    assert not pool.k_buffers[0].any() and pool.k_buffers[0].dtype == torch.bfloat16
    pool.k_buffers[0][:16] = 1.5  # writable, zero elsewhere
    assert pool.k_buffers[0].float().sum().item() == 16 * 8 * 64 * 1.5
    del pool
    plain = GenericPlatform(DeviceInfo(target="bare", device_type="cpu"))
    buf = plain.zeros((size // 2,), torch.uint8, torch.device("cpu"))
    assert buf.shape == (size // 2,) and buf.dtype == torch.uint8 and not buf.any()


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
    from plugins.hardware.cpu_runtime import CpuPlatform
    from plugins.hardware.gpu import TorchCudaPlatform

    assert PROFILES["h100"].graph_capture is True
    assert select_device(build_registry(), "cpu").graph_capture is (c_compiler() is not None)
    monkeypatch.setattr(CpuPlatform, "graphs", lambda self: GraphSupport(False, "no cc"))
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


class DuckPlatform:
    """Every member, but not a BasePlatform: what a Platform was before the base class."""

    def __init__(self, info):
        self.info = info

    def graphs(self):
        return GraphSupport(False, "duck")


AN_INSTANCE = GenericPlatform(DeviceInfo(target="x", device_type="cpu"))


class _Target:
    """A hardware plugin registering `platform` (and an attention backend, rolled back with it)."""

    CORE_PLUGIN_API = ">=1.0,<2"

    def __init__(self, platform):
        self.platform = platform

    @hookimpl
    def core_register_hardware(self, register):
        register("duck_accel", HardwareCaps(device_type="cpu"),
                 lambda: DeviceInfo(target="duck_accel", device_type="cpu"),
                 platform=self.platform)

    @hookimpl
    def core_register_attention_backends(self, register):
        from core.contract.capabilities import AttentionCaps

        register("duck_attn", AttentionCaps(devices={"duck_accel"}), "x:y")


@pytest.mark.parametrize("platform,match", [
    (DuckPlatform, "test_platform.DuckPlatform is not a subclass of "
                   "core.contract.platform.BasePlatform"),
    (f"{__name__}:DuckPlatform", "is not a subclass of core.contract.platform.BasePlatform"),
    ("collections:OrderedDict", "collections.OrderedDict is not a subclass"),
    (f"{__name__}:MEMBERS", "is neither a BasePlatform subclass nor a factory"),
    (f"{__name__}:AN_INSTANCE", "an instance of GenericPlatform was given: register its class"),
    (AN_INSTANCE, "platform must be callable or 'module:attr'"),
    ("no_such_module_here:Platform", "cannot be loaded (ModuleNotFoundError"),
], ids=["class", "reference", "other-class", "not-callable", "instance-reference", "instance",
        "missing-module"])
def test_a_platform_that_is_not_a_base_platform_is_refused_when_the_plugin_loads(platform,
                                                                                   match):
    registry = build_registry(extra=[("duck", _Target(platform))], entry_points=False)
    assert [f.stage for f in registry.failures] == ["register"]
    assert "hardware 'duck_accel': platform" in registry.failures[0].error
    assert match in registry.failures[0].error
    # the whole plugin is rolled back: nothing of it is half-registered
    assert "duck_accel" not in registry.kind("hardware")
    assert "duck_attn" not in registry.kind("attention")


def test_core_backends_lists_the_refused_platform(capsys, monkeypatch, clean_plugin_env):
    from core.cli import main

    monkeypatch.setattr(plugins, "_extra", [("duck_plugin", _Target(DuckPlatform))])
    monkeypatch.setattr(plugins, "_cached", None)
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "failed to load:" in out
    line = next(x for x in out.splitlines() if "duck_plugin" in x)
    assert "at register" in line and "is not a subclass of core.contract.platform.BasePlatform" \
        in line, line
    assert "duck_accel" not in out.split("failed to load:")[0]
    assert main(["backends", "--json"]) == 0
    failures = __import__("json").loads(capsys.readouterr().out)["failures"]
    assert [f["stage"] for f in failures if f["plugin"] == "duck_plugin"] == ["register"]


def test_a_factory_is_taken_and_its_product_checked():
    """A callable that is not a class is a factory: registered, and what it builds must be a
    BasePlatform (a clear TypeError otherwise, naming the target)."""
    good = build_registry(extra=[("f", _Target(lambda info: GenericPlatform(info)))],
                          entry_points=False)
    assert not good.failures
    assert isinstance(load_platform(good, good.probe("duck_accel")), GenericPlatform)
    bad = build_registry(extra=[("f", _Target(lambda info: DuckPlatform(info)))],
                         entry_points=False)
    assert not bad.failures
    with pytest.raises(TypeError, match="hardware target 'duck_accel'.*returned DuckPlatform, "
                                        "not a core.contract.platform.BasePlatform"):
        load_platform(bad, bad.probe("duck_accel"))


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
    assert {f"cpu-{c}" for c in ("memory", "defaults", "zeros", "copies", "graphs", "overlap",
                                 "dist", "post_load")} <= ids


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
    monkeypatch.setattr(CpuPlatform, "zeros",
                        lambda self, shape, dtype, device: torch.ones(shape, dtype=dtype))
    with pytest.raises(AssertionError, match="is not zero"):
        platform_suite.test_platform_conformance("cpu", "zeros")
