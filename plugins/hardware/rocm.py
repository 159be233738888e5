"""`rocm` hardware target: AMD GPUs through a ROCm (HIP) build of torch.

ROCm runs through torch's `cuda` device type, so `device_type` is "cuda" and tensors live on
"cuda:N". The GPU is named by its gfx target (gfx942 = MI300X/MI325X, gfx950 = MI350/MI355X),
which is what kernels are compiled for; a CUDA-style sm number would mean nothing here.
"""

from __future__ import annotations

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = HardwareCaps(
    device_type="cuda",
    vendor="AMD",
    # torch exposes RCCL under the "nccl" backend name, so that is what init_process_group takes.
    dist_backend="nccl",
    description="AMD GPUs through torch.cuda on a ROCm (HIP) build of torch",
    priority=100,  # never available together with `cuda`: a torch build is one or the other
)

# CDNA data-center parts: matrix cores (MFMA) with int8; BF16 MFMA from gfx90a (MI200) on.
_CDNA = ("gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")
# FP8 MFMA: MI300 (gfx94x, the FNUZ variants e4m3fnuz/e5m2fnuz) and MI350 (gfx950, OCP e4m3/e5m2).
_FP8 = {"gfx940": "fnuz", "gfx941": "fnuz", "gfx942": "fnuz", "gfx950": "ocp"}


def features_for(arch: str) -> frozenset[str]:
    """Features of an AMD GPU from its gfx target name (without the :sramecc+:xnack- suffix)."""
    feats = {"fp16"}
    rdna_wmma = arch.startswith(("gfx11", "gfx12"))  # RDNA3/4 WMMA: fp16, bf16, int8
    if arch in _CDNA or rdna_wmma:
        feats.add("int8_mma")
    if (arch in _CDNA and arch != "gfx908") or rdna_wmma:
        feats.add("bf16")
    if arch in _FP8:
        feats.add("fp8")
    return frozenset(feats)


def _absent(reason: str) -> DeviceInfo:
    return DeviceInfo(target="rocm", device_type="cuda", available=False, reason=reason,
                      vendor=CAPS.vendor, dist_backend=CAPS.dist_backend)


def probe() -> DeviceInfo:
    """Describe device 0 and count the visible devices; unavailable (with a reason) otherwise."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is a reason, not a crash
        return _absent(f"torch cannot be imported ({type(exc).__name__}: {exc})")
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return _absent("torch was built without ROCm (torch.version.hip is None)")
    if not torch.cuda.is_available():
        return _absent(f"no ROCm device: torch.cuda.is_available() is False "
                       f"(torch built with HIP {hip})")
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    # e.g. "gfx942:sramecc+:xnack-": the target features after ':' do not change the ISA.
    arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    extra: dict[str, object] = {"torch_hip": hip, "compute_units": props.multi_processor_count,
                                "arch_version": f"{props.major}.{props.minor}"}
    if arch in _FP8:
        extra["fp8_format"] = _FP8[arch]
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    if len(set(names)) > 1:
        extra["devices"] = names
    return DeviceInfo(
        target="rocm",
        device_type="cuda",
        available=True,
        name=props.name,
        vendor=CAPS.vendor,
        count=count,
        arch=arch,
        capability=None,  # ROCm is matched by gfx arch (CapabilityRange.archs), not by number
        memory_bytes=int(props.total_memory),
        features=features_for(arch or ""),
        dist_backend=CAPS.dist_backend,
        extra=extra,
    )


@hookimpl
def core_register_hardware(register):
    register("rocm", CAPS, probe, platform="plugins.hardware.gpu:TorchCudaPlatform")
