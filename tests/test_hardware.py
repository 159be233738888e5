"""Hardware target plugins: honest probes here, faked accelerators, failure isolation."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl
from core.plan.registry import PluginError, build_registry
from plugins.hardware import cpu, cuda, npu, rocm, xpu

TARGETS = ("cuda", "rocm", "xpu", "npu", "cpu")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for var in ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY"):
        monkeypatch.delenv(var, raising=False)


def _proc_cpuinfo() -> tuple[str, set[str]]:
    """A fresh, independent read of the first processor's model name and flags."""
    name, flags = "", None
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not name:
                name = value.strip()
            if key in ("flags", "Features") and flags is None:
                flags = set(value.split())
    return name, flags or set()


# ---------------------------------------------------------------------------------------------
# registration through the real entry points


def test_all_five_targets_register_from_entry_points():
    reg = build_registry()
    hw = reg.kind("hardware")
    assert set(TARGETS) <= set(hw)
    for name in TARGETS:
        assert isinstance(hw[name].caps, HardwareCaps)
        assert hw[name].origin.dist == "core-serve"
    assert not [f for f in reg.failures if f.origin.plugin.startswith("hardware_")]
    # any accelerator outranks the CPU when --device is left open
    assert all(hw[n].caps.priority > hw["cpu"].caps.priority for n in TARGETS if n != "cpu")
    assert hw["rocm"].caps.device_type == "cuda"  # ROCm runs through torch's cuda device
    assert hw["npu"].caps.requires == ("torch_npu",)


def test_every_target_registers_a_base_platform_subclass():
    """Resolved and checked when the plugin registered (core.contract.platform.BasePlatform)."""
    from core.contract.platform import BasePlatform

    hw = build_registry().kind("hardware")
    for name in TARGETS:
        assert isinstance(hw[name].platform, type) and issubclass(hw[name].platform,
                                                                  BasePlatform), name


# ---------------------------------------------------------------------------------------------
# this machine


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="needs Linux /proc/meminfo")
def test_cpu_host_free_memory_is_mem_available_capped_by_the_cgroup(monkeypatch, tmp_path):
    """The cpu target's own reading of free host memory (its Platform's memory())."""
    free = cpu.host_free_bytes()
    assert 0 < free <= cpu.probe().memory_bytes
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    2000000 kB\n")
    monkeypatch.setattr(cpu, "MEMINFO", str(meminfo))
    monkeypatch.setattr(cpu, "cgroup_headroom", lambda: None)
    assert cpu.host_free_bytes() == 2000000 * 1024
    monkeypatch.setattr(cpu, "cgroup_headroom", lambda: 1024)
    assert cpu.host_free_bytes() == 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    with pytest.raises(ValueError, match="cannot read MemAvailable"):
        cpu.host_free_bytes()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux /proc/cpuinfo")
def test_cpu_probe_reports_the_flags_in_proc_cpuinfo():
    info = cpu.probe()
    name, flags = _proc_cpuinfo()
    assert info.available and info.target == "cpu" and info.device_type == "cpu"
    # "bf16" is both an Arm flag and a derived feature; it is checked below
    for flag in set(cpu.ISA_FLAGS) - {"bf16"}:
        assert info.has(flag) == (flag in flags), flag
    # derived features follow the flags, e.g. no AMX flags -> no amx_* features
    assert info.has("bf16") == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert info.has("int8_mma") == bool(flags & {"amx_int8", "avx512_vnni", "i8mm"})
    assert info.has("fp16")
    if name:
        assert info.name == name
    with open("/proc/meminfo") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert info.memory_bytes == total_kb * 1024
    assert info.count == 1 and info.extra["cores"] == os.cpu_count()
    assert info.dist_backend == "gloo" and info.graph_capture is False
    assert info.arch and " " not in info.arch


def test_cpu_probe_falls_back_to_torch_without_proc(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "CPUINFO", str(tmp_path / "absent"))
    info = cpu.probe()
    assert info.available
    cap = torch.backends.cpu.get_cpu_capability()
    assert cap in info.extra["isa_source"]
    assert info.has("avx512f") == cap.startswith("AVX512")
    assert info.has("avx2") == cap.startswith(("AVX2", "AVX512"))


def test_cpu_features_from_a_sapphire_rapids_cpuinfo(monkeypatch, tmp_path):
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8\n"
            "\nprocessor\t: 1\nflags\t\t: fpu\n")
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    monkeypatch.setattr(cpu, "CPUINFO", str(path))
    info = cpu.probe()
    assert info.name == "Intel(R) Xeon(R) Platinum 8480+" and info.vendor == "Intel"
    assert {"amx_bf16", "amx_int8", "amx_tile", "avx512f", "bf16", "int8_mma"} <= info.features
    assert "fpu" not in info.features  # only flags kernels ask about are kept


def test_cpu_features_plain_avx2_and_arm():
    assert cpu.features_for({"avx2", "sse2"}) == {"avx2", "fp16"}
    arm = cpu.features_for({"asimd", "sve", "bf16", "i8mm"})
    assert {"sve", "bf16", "i8mm", "int8_mma"} <= arm and "avx2" not in arm


def test_accelerators_report_honestly_on_this_machine():
    reg = build_registry()
    infos = {t: reg.probe(t) for t in TARGETS}
    assert infos["cpu"].available
    cuda_info, rocm_info = infos["cuda"], infos["rocm"]
    if torch.version.cuda is None:
        assert not cuda_info.available
        assert "torch.version.cuda is None" in cuda_info.reason
    else:
        assert cuda_info.available == torch.cuda.is_available()
    if torch.version.hip is None:
        assert not rocm_info.available and "torch.version.hip is None" in rocm_info.reason
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        assert not infos["xpu"].available and "xpu" in infos["xpu"].reason.lower()
    if importlib.util.find_spec("torch_npu") is None:
        assert not infos["npu"].available
        assert infos["npu"].reason == "package torch_npu is not installed"
    for info in infos.values():
        assert isinstance(info, DeviceInfo) and not info.simulated
        assert info.available or info.reason  # every absence comes with a reason
    assert not [f for f in reg.failures if f.stage == "probe"]


# ---------------------------------------------------------------------------------------------
# faked accelerators


def _fake_gpu(monkeypatch, *, cuda_version, hip, major, minor, arch="", count=2,
              name="Fake GPU"):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.version, "hip", hip)
    props = SimpleNamespace(name=name, major=major, minor=minor, total_memory=80 * 2**30,
                            multi_processor_count=132, gcnArchName=arch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)


@pytest.mark.parametrize("cap,present,absent", [
    ((9, 0), {"fp16", "bf16", "fp8", "int8_mma", "tensor_cores"}, {"fp4"}),
    ((8, 9), {"bf16", "fp8"}, {"fp4"}),
    ((8, 0), {"bf16", "int8_mma", "tensor_cores"}, {"fp8"}),
    ((7, 5), {"fp16", "int8_mma", "tensor_cores"}, {"bf16", "fp8"}),
    ((7, 0), {"tensor_cores"}, {"int8_mma", "bf16"}),
    ((10, 0), {"fp8", "fp4", "bf16"}, set()),
])
def test_cuda_probe_with_fake_torch_cuda(monkeypatch, cap, present, absent):
    _fake_gpu(monkeypatch, cuda_version="12.4", hip=None, major=cap[0], minor=cap[1],
              name="NVIDIA H100")
    info = cuda.probe()
    number = cap[0] * 10 + cap[1]
    assert info.available and info.count == 2
    assert info.capability == number and info.arch == f"sm{number}"
    assert present <= info.features and not (absent & info.features)
    assert info.memory_bytes == 80 * 2**30 and info.device_type == "cuda"
    assert info.dist_backend == "nccl" and not info.graph_capture  # the Platform decides
    # the same torch is not a ROCm build
    assert not rocm.probe().available


def test_cuda_probe_without_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = cuda.probe()
    assert not info.available and "torch.cuda.is_available() is False" in info.reason


@pytest.mark.parametrize("gcn,arch,fp8,bf16", [
    ("gfx942:sramecc+:xnack-", "gfx942", True, True),
    ("gfx950", "gfx950", True, True),
    ("gfx90a:sramecc+:xnack-", "gfx90a", False, True),
    ("gfx908", "gfx908", False, False),
    ("gfx1100", "gfx1100", False, True),
])
def test_rocm_probe_with_fake_hip_build(monkeypatch, gcn, arch, fp8, bf16):
    _fake_gpu(monkeypatch, cuda_version=None, hip="6.2.41133", major=9, minor=4, arch=gcn,
              name="AMD Instinct MI300X")
    info = rocm.probe()
    assert info.available and info.target == "rocm" and info.device_type == "cuda"
    assert info.arch == arch and info.capability is None
    assert info.has("fp8") == fp8 and info.has("bf16") == bf16
    assert info.dist_backend == "nccl" and not info.graph_capture  # the Platform decides
    if fp8:
        assert info.extra["fp8_format"] == ("fnuz" if arch == "gfx942" else "ocp")
    cuda_info = cuda.probe()  # a HIP build must not be described as an NVIDIA GPU
    assert not cuda_info.available and "ROCm" in cuda_info.reason


def test_xpu_probe_with_fake_torch_xpu(monkeypatch):
    props = SimpleNamespace(name="Intel(R) Data Center GPU Max 1550", total_memory=64 * 2**30,
                            has_fp16=True, has_subgroup_matrix_multiply_accumulate=True,
                            driver_version="1.3")
    fake = SimpleNamespace(is_available=lambda: True, device_count=lambda: 4,
                           get_device_properties=lambda i=0: props,
                           is_bf16_supported=lambda: True)
    monkeypatch.setattr(torch, "xpu", fake)
    info = xpu.probe()
    assert info.available and info.count == 4 and info.device_type == "xpu"
    assert {"fp16", "bf16", "xmx", "int8_mma"} <= info.features
    assert info.dist_backend == "xccl" and info.memory_bytes == 64 * 2**30
    assert info.graph_capture is False  # the Platform decides (core.contract.platform)
    # an Arc-like part without XMX
    plain = SimpleNamespace(name="iGPU", total_memory=2**30, has_fp16=True)
    monkeypatch.setattr(fake, "get_device_properties", lambda i=0: plain)
    monkeypatch.setattr(fake, "is_bf16_supported", lambda: False)
    assert xpu.probe().features == {"fp16"}


def test_xpu_probe_without_torch_xpu(monkeypatch):
    monkeypatch.delattr(torch, "xpu", raising=False)
    info = xpu.probe()
    assert not info.available and "no torch.xpu" in info.reason


def test_npu_probe_paths(monkeypatch):
    # npu.importlib.util is the global importlib.util: the patch lasts for this test only
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name, *a: None)
    assert npu.probe().reason == "package torch_npu is not installed"

    spec = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name, *a: spec)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    broken = npu.probe()
    assert not broken.available and "torch_npu failed to import" in broken.reason

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    props = SimpleNamespace(name="Ascend910B3", total_memory=64 * 2**30, cube_core_num=20)
    fake = SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                           get_device_properties=lambda i=0: props,
                           get_device_name=lambda i=0: props.name)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    info = npu.probe()
    assert info.available and info.count == 8 and info.device_type == "npu"
    assert {"fp16", "bf16", "int8_mma"} <= info.features  # 910B has BF16
    assert info.dist_backend == "hccl" and info.extra["cube_core_num"] == 20
    props.name = "Ascend910A"
    assert not npu.probe().has("bf16")
    monkeypatch.setattr(fake, "is_available", lambda: False, raising=False)
    assert "torch.npu.is_available() is False" in npu.probe().reason


# ---------------------------------------------------------------------------------------------
# failure isolation of probes


class _RaisingProbe:
    CORE_PLUGIN_API = ">=1.0,<2"

    @staticmethod
    def _probe():
        raise RuntimeError("driver exploded")

    @hookimpl
    def core_register_hardware(self, register):
        register("boomgpu", HardwareCaps(device_type="cuda", priority=1000), self._probe)


class _WrongType:
    @hookimpl
    def core_register_hardware(self, register):
        register("liar", HardwareCaps(device_type="cpu"), lambda: {"available": True})


def test_raising_probe_is_isolated_and_recorded():
    reg = build_registry(extra=[("boom", _RaisingProbe()), ("liar", _WrongType())])
    info = reg.probe("boomgpu")
    assert not info.available and "driver exploded" in info.reason
    assert info.device_type == "cuda"
    failures = [f for f in reg.failures if f.stage == "probe"]
    assert [f.origin.plugin for f in failures] == ["boom"]
    assert "RuntimeError" in failures[0].error
    assert not reg.probe("liar").available
    assert "not DeviceInfo" in reg.failures[-1].error
    assert reg.probe("cpu").available  # the others still probe


def test_raising_probe_is_fatal_in_strict_mode(monkeypatch):
    monkeypatch.setenv("CORE_STRICT_PLUGINS", "1")
    reg = build_registry(extra=[("boom", _RaisingProbe())])
    with pytest.raises(PluginError, match="boomgpu.*driver exploded"):
        reg.probe("boomgpu")


# ---------------------------------------------------------------------------------------------
# on an accelerator (pytest -m gpu)


@pytest.mark.gpu
def test_real_cuda_probe_matches_torch():
    assert torch.cuda.is_available(), "run -m gpu on a machine with a CUDA GPU"
    from core.contract.platform import load_platform

    registry = build_registry()
    info = registry.probe("rocm" if torch.version.hip else "cuda")
    major, minor = torch.cuda.get_device_capability(0)
    assert info.available and info.count == torch.cuda.device_count()
    assert info.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    if not torch.version.hip:
        assert info.capability == major * 10 + minor
        assert info.features == cuda.features_for(info.capability)
    free, _ = load_platform(registry, info).memory(0)  # what the engine sizes KV from
    assert 0 < free <= info.memory_bytes
