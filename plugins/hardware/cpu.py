"""`cpu` hardware target: the host processor, always available, with its ISA extensions.

The features that kernels care about (AMX tiles, AVX-512 BF16/VNNI, AVX2) are read from the
kernel's view of the CPU in /proc/cpuinfo, so a flag the OS has not enabled (AMX needs kernel
support for its tile state) is not reported. Where /proc is absent the probe falls back to what
torch's own CPU dispatch detected.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = HardwareCaps(
    device_type="cpu",
    vendor="",
    dist_backend="gloo",
    description="host CPU through torch's cpu device (AMX / AVX-512 / AVX2 detection)",
    priority=0,  # last resort: any available accelerator wins
)

# The ISA flags (Linux /proc/cpuinfo spelling) that backends may ask for. x86 first, then Arm.
ISA_FLAGS = (
    "amx_bf16", "amx_int8", "amx_tile", "amx_fp16",
    "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
    "avx2", "fma", "f16c",
    "sve", "sve2", "i8mm", "bf16",  # aarch64 "Features" names
)

_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}
_MACHINES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}

CPUINFO = "/proc/cpuinfo"
MEMINFO = "/proc/meminfo"


def read_cpuinfo(path: str | None = None) -> dict[str, str] | None:
    """The fields of the first processor block of /proc/cpuinfo, or None if unreadable."""
    try:
        with open(path or CPUINFO, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields.get("flags") or fields.get("Features"):
                break  # every processor repeats the same block; the first is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def read_meminfo(key: str, path: str | None = None) -> int | None:
    """One /proc/meminfo value in bytes (MemTotal, MemAvailable), or None if unreadable."""
    try:
        with open(path or MEMINFO, encoding="utf-8") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    parts = rest.split()
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    return int(parts[0]) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup may still take, or None when there is no limit."""
    candidates = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                   "/sys/fs/cgroup/memory/memory.usage_in_bytes"))  # cgroup v1
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max":
            return None
        limit = int(raw)
        if limit >= 2**62:  # v1 spells "unlimited" as a huge page-aligned number
            return None
        return max(limit - usage, 0)
    return None


def host_free_bytes() -> int:
    """Host memory this process may still take: MemAvailable, capped by its cgroup's headroom."""
    avail = read_meminfo("MemAvailable")
    if avail is None:
        raise ValueError(f"cannot read MemAvailable from {MEMINFO} to size host memory")
    headroom = cgroup_headroom()
    return avail if headroom is None else min(avail, headroom)


def _torch_isa_flags() -> tuple[set[str], str]:
    """Fallback when /proc/cpuinfo is absent: what torch's CPU dispatch found."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch must not break the probe
        return set(), f"torch cannot be imported ({type(exc).__name__}: {exc})"
    flags: set[str] = set()
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    if cap.startswith("AVX512"):
        flags |= {"avx512f", "avx2"}
    elif cap.startswith("AVX2"):
        flags.add("avx2")
    elif cap.startswith("SVE"):
        flags.add("sve")
    # Private helpers of torch's cpuinfo binding; used only where present.
    probes = {"amx_tile": "_is_amx_tile_supported", "amx_fp16": "_is_amx_fp16_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "avx512_vnni": "_is_avx512_vnni_supported"}
    cpu_mod = getattr(torch._C, "_cpu", None)
    for flag, fn in probes.items():
        check = getattr(cpu_mod, fn, None)
        try:
            if check is not None and check():
                flags.add(flag)
        except Exception:  # noqa: BLE001 - an unsupported query means "unknown"
            continue
    return flags, f"torch.backends.cpu.get_cpu_capability()={cap}"


def features_for(flags: Iterable[str]) -> frozenset[str]:
    """Device features derived from the raw ISA flags (kept as features too)."""
    isa = set(flags) & set(ISA_FLAGS)
    feats = set(isa) | {"fp16"}  # fp16 storage and conversion work everywhere torch runs
    if isa & {"avx512_bf16", "amx_bf16", "bf16"}:
        feats.add("bf16")
    if isa & {"amx_int8", "avx512_vnni", "i8mm"}:
        feats.add("int8_mma")
    return frozenset(feats)


def _machine() -> str:
    m = platform.machine().lower() or "unknown"
    return _MACHINES.get(m, m)


def probe() -> DeviceInfo:
    """Describe the host CPU; never fails (a missing source just leaves fields empty)."""
    info = read_cpuinfo()
    extra: dict[str, object] = {"cores": os.cpu_count() or 1}
    if hasattr(os, "sched_getaffinity"):
        extra["usable_cores"] = len(os.sched_getaffinity(0))
    if info is not None and (info.get("flags") or info.get("Features")):
        flags = set((info.get("flags") or info.get("Features") or "").split())
        extra["isa_source"] = CPUINFO
        name = info.get("model name") or info.get("Processor") or info.get("CPU part") or ""
        vendor = _VENDORS.get(info.get("vendor_id", ""), info.get("vendor_id", ""))
    else:
        flags, source = _torch_isa_flags()
        extra["isa_source"] = source
        name, vendor = platform.processor(), ""
    memory = read_meminfo("MemTotal")
    if memory is None and hasattr(os, "sysconf"):
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = None
    return DeviceInfo(
        target="cpu",
        device_type="cpu",
        available=True,
        name=name or _machine(),
        vendor=vendor,
        count=1,  # the host is one device; NUMA placement is not modelled
        arch=_machine(),
        capability=None,
        memory_bytes=memory or 0,
        features=features_for(flags),
        dist_backend=CAPS.dist_backend,
        extra=extra,
    )


@hookimpl
def core_register_hardware(register):
    register("cpu", CAPS, probe, platform="plugins.hardware.cpu_runtime:CpuPlatform")
