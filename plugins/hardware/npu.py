"""`npu` hardware target: Huawei Ascend NPUs through the torch_npu extension (torch.npu).

torch_npu is looked up before it is imported: importing it patches torch, which nobody without an
NPU should pay for, and its absence is the common case and a plain reason.
"""

from __future__ import annotations

import importlib
import importlib.util

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = HardwareCaps(
    device_type="npu",
    vendor="Huawei",
    dist_backend="hccl",
    description="Huawei Ascend NPUs through torch_npu (torch.npu); its Platform (plugins/"
                "hardware/accel.py) is written from the documented API and untested here: no "
                "graphs, no overlap",
    requires=("torch_npu",),
    priority=90,
)


def _absent(reason: str) -> DeviceInfo:
    return DeviceInfo(target="npu", device_type="npu", available=False, reason=reason,
                      vendor=CAPS.vendor, dist_backend=CAPS.dist_backend)


def features_for(name: str, bf16: bool | None = None) -> frozenset[str]:
    """Features of an Ascend NPU. The cube unit does fp16 and int8 on every Ascend part; BF16
    arrived with the 910B generation (910B*, 910_93*), which torch_npu reports when asked."""
    feats = {"fp16", "int8_mma"}
    if bf16 is None:
        compact = name.replace(" ", "").lower()
        bf16 = "910b" in compact or "910_93" in compact
    if bf16:
        feats.add("bf16")
    return frozenset(feats)


def probe() -> DeviceInfo:
    """Describe NPU 0 and count the visible NPUs; unavailable (with a reason) otherwise."""
    if importlib.util.find_spec("torch_npu") is None:
        return _absent("package torch_npu is not installed")
    try:
        import torch

        importlib.import_module("torch_npu")  # registers torch.npu
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return _absent(f"torch_npu failed to import ({type(exc).__name__}: {exc})")
    npu = getattr(torch, "npu", None)
    if npu is None:
        return _absent("torch_npu is installed but torch.npu is missing")
    if not npu.is_available():
        return _absent("no NPU device: torch.npu.is_available() is False")
    count = npu.device_count()
    props = npu.get_device_properties(0)
    name = str(getattr(props, "name", "") or npu.get_device_name(0))
    bf16 = None
    if hasattr(npu, "is_bf16_supported"):
        try:
            bf16 = bool(npu.is_bf16_supported())
        except Exception:  # noqa: BLE001 - unknown, infer from the part name
            bf16 = None
    extra = {k: getattr(props, k) for k in ("cube_core_num", "vector_core_num")
             if hasattr(props, k)}
    return DeviceInfo(
        target="npu",
        device_type="npu",
        available=True,
        name=name,
        vendor=CAPS.vendor,
        count=count,
        arch=name or None,  # Ascend kernels are built per SoC, which the name identifies
        capability=None,
        memory_bytes=int(getattr(props, "total_memory", 0)),
        features=features_for(name, bf16),
        dist_backend=CAPS.dist_backend,
        extra=extra,
    )


@hookimpl
def core_register_hardware(register):
    register("npu", CAPS, probe, platform="plugins.hardware.accel:NpuPlatform")
