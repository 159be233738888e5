"""`xpu` hardware target: Intel GPUs (Data Center Max, Arc, integrated Xe) through torch.xpu."""

from __future__ import annotations

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = HardwareCaps(
    device_type="xpu",
    vendor="Intel",
    dist_backend="xccl",
    description="Intel GPUs through torch.xpu (SYCL / Level Zero); its Platform (plugins/hardware/"
                "accel.py) is written from the documented API and untested here: no graphs, "
                "no overlap",
    priority=90,
)


def _absent(reason: str) -> DeviceInfo:
    return DeviceInfo(target="xpu", device_type="xpu", available=False, reason=reason,
                      vendor=CAPS.vendor, dist_backend=CAPS.dist_backend)


def features_for(props: object, bf16: bool | None = None) -> frozenset[str]:
    """Features from torch.xpu device properties; a property torch does not expose stays unknown
    (absent) rather than guessed."""
    feats = set()
    if getattr(props, "has_fp16", False):
        feats.add("fp16")
    # XMX (Xe Matrix eXtensions) is what SYCL calls subgroup matrix multiply-accumulate.
    if getattr(props, "has_subgroup_matrix_multiply_accumulate", False):
        feats |= {"xmx", "int8_mma"}
    if bf16 is None:
        bf16 = bool(getattr(props, "has_bfloat16_conversions", False))
    if bf16:
        feats.add("bf16")
    return frozenset(feats)


def probe() -> DeviceInfo:
    """Describe XPU 0 and count the visible XPUs; unavailable (with a reason) otherwise."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is a reason, not a crash
        return _absent(f"torch cannot be imported ({type(exc).__name__}: {exc})")
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return _absent(f"torch {torch.__version__} has no torch.xpu module")
    if not xpu.is_available():
        return _absent("no XPU device: torch.xpu.is_available() is False")
    count = xpu.device_count()
    props = xpu.get_device_properties(0)
    bf16 = None
    if hasattr(xpu, "is_bf16_supported"):
        try:
            bf16 = bool(xpu.is_bf16_supported())
        except Exception:  # noqa: BLE001 - unknown, fall back to the properties
            bf16 = None
    extra: dict[str, object] = {}
    for key in ("driver_version", "max_compute_units", "gpu_eu_count", "platform_name"):
        if hasattr(props, key):
            extra[key] = getattr(props, key)
    arch = getattr(props, "architecture", None)  # an enum value in recent torch; keep its name
    return DeviceInfo(
        target="xpu",
        device_type="xpu",
        available=True,
        name=str(getattr(props, "name", "Intel XPU")),
        vendor=CAPS.vendor,
        count=count,
        arch=str(arch) if arch is not None else None,
        capability=None,
        memory_bytes=int(getattr(props, "total_memory", 0)),
        features=features_for(props, bf16),
        dist_backend=CAPS.dist_backend,
        extra=extra,
    )


@hookimpl
def core_register_hardware(register):
    register("xpu", CAPS, probe, platform="plugins.hardware.accel:XpuPlatform")
