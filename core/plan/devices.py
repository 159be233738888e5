"""Devices: choosing the one to run on (or plan for), simulated profiles, free memory.

A device is either what a hardware plugin's probe found, or a simulated profile (a built-in name
such as "h100" or "mi300x", or a JSON file of DeviceInfo fields) so that a plan for hardware that
is not here can be made and tested. Profiles carry public datasheet facts only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from core.contract.capabilities import DeviceInfo
from core.contract.platform import with_graph_support
from core.plan.registry import Registry

GiB = 2**30
MiB = 2**20

# CUDA feature sets by generation; kept in step with plugins/hardware/cuda.py (a test checks it).
_SM75 = ("fp16", "tensor_cores", "int8_mma")
_SM80 = (*_SM75, "bf16")
_SM89 = (*_SM80, "fp8")
_SM100 = (*_SM89, "fp4")


def _gpu(target: str, name: str, arch: str, capability: int | None, memory: int,
         features: tuple[str, ...], vendor: str, dist: str, device_type: str = "cuda",
         **extra: object) -> DeviceInfo:
    # graph_capture: what the target's Platform declares (select_device re-derives it from the
    # Platform; a test checks the two agree): CUDA and ROCm capture, XPU and NPU do not yet.
    return DeviceInfo(target=target, device_type=device_type, name=name, vendor=vendor, count=1,
                      arch=arch, capability=capability, memory_bytes=memory, features=features,
                      dist_backend=dist, graph_capture=device_type == "cuda", simulated=True,
                      extra=extra)


def _cpu(name: str, vendor: str, memory: int, features: tuple[str, ...], **extra: object
         ) -> DeviceInfo:
    return DeviceInfo(target="cpu", device_type="cpu", name=name, vendor=vendor, count=1,
                      arch="x86_64", memory_bytes=memory, features=features, dist_backend="gloo",
                      # the CPU Platform captures graphs of C calls where a C compiler is
                      # (select_device re-derives it from the Platform on this machine)
                      graph_capture=True, simulated=True, extra=extra)


# Memory is what the device reports as total, not the marketing figure. The H200 (sold as 141 GB)
# is torch's total_memory as read on one (about 139.8 GiB; nvidia-smi says 143771 MiB); the other
# NVIDIA parts use nvidia-smi's MiB total, which runs about 0.5% above torch's figure.
PROFILES: dict[str, DeviceInfo] = {
    "h200": _gpu("cuda", "NVIDIA H200", "sm90", 90, 150_109_880_320, _SM89, "NVIDIA", "nccl",
                 multiprocessors=132),
    "h100": _gpu("cuda", "NVIDIA H100 80GB HBM3", "sm90", 90, 81559 * MiB, _SM89, "NVIDIA",
                 "nccl", multiprocessors=132),
    "a100": _gpu("cuda", "NVIDIA A100-SXM4-80GB", "sm80", 80, 81920 * MiB, _SM80, "NVIDIA",
                 "nccl", multiprocessors=108),
    "l4": _gpu("cuda", "NVIDIA L4", "sm89", 89, 23034 * MiB, _SM89, "NVIDIA", "nccl",
               multiprocessors=58),
    "t4": _gpu("cuda", "Tesla T4", "sm75", 75, 15360 * MiB, _SM75, "NVIDIA", "nccl",
               multiprocessors=40),
    "b200": _gpu("cuda", "NVIDIA B200", "sm100", 100, 183359 * MiB, _SM100, "NVIDIA", "nccl",
                 multiprocessors=148),
    # ROCm: torch's cuda device; MI300X is gfx942 with FNUZ-flavoured FP8.
    "mi300x": _gpu("rocm", "AMD Instinct MI300X", "gfx942", None, 192 * GiB,
                   ("fp16", "bf16", "fp8", "int8_mma"), "AMD", "nccl", compute_units=304,
                   fp8_format="fnuz"),
    "intel-max-1550": _gpu("xpu", "Intel(R) Data Center GPU Max 1550", "pvc", None, 128 * GiB,
                           ("fp16", "bf16", "xmx", "int8_mma"), "Intel", "xccl",
                           device_type="xpu", max_compute_units=1024),
    "ascend-910b": _gpu("npu", "Ascend910B2", "Ascend910B2", None, 64 * GiB,
                        ("fp16", "bf16", "int8_mma"), "Huawei", "hccl", device_type="npu",
                        cube_core_num=24),
    # Sapphire Rapids: AMX tiles (BF16, INT8) beside AVX-512 BF16/VNNI.
    "xeon-amx": _cpu("Intel(R) Xeon(R) Platinum 8480+", "Intel", 256 * GiB,
                     ("amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512vl",
                      "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c", "fp16", "bf16",
                      "int8_mma"),
                     cores=56, microarchitecture="sapphirerapids"),
    # A plain AVX2 desktop/cloud CPU: no AVX-512, no AMX, no native BF16 dot products.
    "x86-cpu": _cpu("x86-64 AVX2 CPU", "", 32 * GiB, ("avx2", "fp16"), cores=8),
}

_FIELDS = {f.name: f for f in dataclasses.fields(DeviceInfo)}
_COUNT_SUFFIX = re.compile(r"^(?P<base>.+?)x(?P<count>[0-9]+)$")


def _known() -> str:
    return ", ".join(sorted(PROFILES))


def _check_type(key: str, value: object, path: str) -> None:
    """Type-check one JSON field against DeviceInfo; raise ValueError naming it."""
    def bad(want: str) -> ValueError:
        return ValueError(f"device profile {path}: {key!r} must be {want}, got {value!r}")

    if key in ("target", "device_type"):
        if not isinstance(value, str) or not value.strip():
            raise bad("a non-empty string")
    elif key in ("reason", "name", "vendor", "dist_backend"):
        if not isinstance(value, str):
            raise bad("a string")
    elif key == "arch":
        if value is not None and not isinstance(value, str):
            raise bad("a string or null")
    elif key in ("count", "memory_bytes", "capability"):
        if key == "capability" and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("a non-negative integer")
        if key == "count" and value < 1:
            raise bad("at least 1")
    elif key in ("available", "simulated", "graph_capture"):
        if not isinstance(value, bool):
            raise bad("true or false")
        if key == "available" and not value:
            raise bad("true (a profile describes a device to plan for)")
    elif key == "features":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
    elif key == "extra" and not isinstance(value, dict):
        raise bad("an object")


def profile_from_dict(data: object, source: str = "<dict>") -> DeviceInfo:
    """Build a simulated DeviceInfo from a mapping of DeviceInfo fields (JSON-shaped)."""
    if not isinstance(data, dict):
        raise ValueError(f"device profile {source}: expected a JSON object of DeviceInfo fields, "
                         f"got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"device profile {source}: unknown key(s) {', '.join(unknown)}; "
                         f"valid keys are {', '.join(_FIELDS)}")
    missing = [k for k in ("target", "device_type") if k not in data]
    if missing:
        raise ValueError(f"device profile {source}: missing required key(s) {', '.join(missing)}")
    for key, value in data.items():
        _check_type(key, value, source)
    fields = dict(data)
    fields.setdefault("count", 1)
    fields["available"] = True
    fields["simulated"] = True
    return DeviceInfo(**fields)


def load_profile(name_or_path: str) -> DeviceInfo:
    """A simulated device: a built-in profile name (optionally with a count, "h200x8"), or the
    path of a JSON file whose keys are DeviceInfo fields."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"device profile must be a name or a JSON file path, got {name_or_path!r}")
    key = name_or_path.strip().lower()
    if key in PROFILES:
        return PROFILES[key]
    m = _COUNT_SUFFIX.match(key)
    if m and m["base"] in PROFILES:
        count = int(m["count"])
        if count < 1:
            raise ValueError(f"device profile {name_or_path!r}: count must be at least 1")
        return dataclasses.replace(PROFILES[m["base"]], count=count)
    looks_like_path = key.endswith(".json") or os.sep in name_or_path or "/" in name_or_path
    if os.path.isfile(name_or_path):
        try:
            with open(name_or_path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"device profile {name_or_path}: invalid JSON ({exc})") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"device profile {name_or_path}: cannot read ({exc})") from exc
        return profile_from_dict(data, name_or_path)
    if looks_like_path:
        raise ValueError(f"device profile file {name_or_path} does not exist")
    raise ValueError(f"unknown device profile {name_or_path!r}; known profiles: {_known()} "
                     f"(a name may end in xN for N devices, e.g. h100x8), or give a JSON file")


def profile_to_json(info: DeviceInfo) -> dict[str, object]:
    """The JSON-ready form of a DeviceInfo; load_profile reads it back (as simulated)."""
    out: dict[str, object] = {}
    for name in _FIELDS:
        value = getattr(info, name)
        if name == "features":
            value = sorted(value)
        elif name == "extra":
            value = dict(value)
        out[name] = value
    out["available"] = True
    out["simulated"] = True
    return out


def _hardware_names(registry: Registry) -> list[str]:
    return sorted(registry.kind("hardware"))


def select_device(registry: Registry, device: str | None = None,
                  profile: str | None = None) -> DeviceInfo:
    """The device to plan for: a simulated profile, the target asked for, or the best available.

    With neither `device` nor `profile`, available targets are tried by HardwareCaps.priority
    (highest first), so an accelerator wins over the CPU. Its graph_capture is what the target's
    Platform declares (core.contract.platform.with_graph_support), for probed and simulated devices alike.
    """
    return with_graph_support(registry, _select(registry, device, profile))


def _select(registry: Registry, device: str | None, profile: str | None) -> DeviceInfo:
    if device is not None and device.strip().lower() == "auto":
        device = None
    if profile is not None:
        info = load_profile(profile)
        if device is not None and device != info.target:
            raise ValueError(f"--device {device} conflicts with device profile {profile!r}, "
                             f"which describes a {info.target} device")
        return info
    targets = registry.kind("hardware")
    if device is not None:
        if device not in targets:
            listed = ", ".join(_hardware_names(registry)) or "none"
            raise ValueError(f"unknown device {device!r}; registered hardware targets: {listed}")
        info = registry.probe(device)
        if not info.available:
            raise ValueError(f"device {device} is not available: {info.reason}")
        return info
    order = sorted(targets.values(), key=lambda r: (-r.caps.priority, r.name))
    reasons = []
    for reg in order:
        info = registry.probe(reg.name)
        if info.available:
            return info
        reasons.append(f"{reg.name}: {info.reason}")
    detail = "; ".join(reasons) or "no hardware plugin is registered"
    raise ValueError(f"no hardware target is available ({detail})")


def _check_index(info: DeviceInfo, index: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"device index must be a non-negative integer, got {index!r}")
    if info.count and index >= info.count:
        raise ValueError(f"device index {index} out of range: {info.target} has {info.count} "
                         f"device(s)")


def torch_device(info: DeviceInfo, index: int = 0) -> str:
    """The torch device string for device `index`: "cuda:0", "xpu:1", "cpu"."""
    _check_index(info, index)
    if info.device_type == "cpu":
        return "cpu"
    return f"{info.device_type}:{index}"
