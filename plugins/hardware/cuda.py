"""`cuda` hardware target: NVIDIA GPUs through a CUDA build of torch.

A ROCm build of torch also answers through `torch.cuda`; that case belongs to the `rocm` target,
so this probe reports itself unavailable there instead of describing an AMD GPU as sm-something.

Probing calls torch.cuda.get_device_properties, which initializes the CUDA runtime in the calling
process (no context on the device): processes started after it must be spawned, not forked.
"""

from __future__ import annotations

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = HardwareCaps(
    device_type="cuda",
    vendor="NVIDIA",
    dist_backend="nccl",
    description="NVIDIA GPUs through torch.cuda (CUDA build of torch)",
    priority=100,
)


def features_for(capability: int) -> frozenset[str]:
    """Features of an NVIDIA GPU from its compute capability (major*10+minor).

    Tensor cores arrived with Volta (sm70), integer MMA with Turing (sm75), BF16 with Ampere
    (sm80), FP8 with Ada (sm89) and Hopper, FP4 with Blackwell (sm100, sm120).
    """
    feats = {"fp16"}
    if capability >= 70:
        feats.add("tensor_cores")
    if capability >= 75:
        feats.add("int8_mma")
    if capability >= 80:
        feats.add("bf16")
    if capability >= 89:
        feats.add("fp8")
    if capability >= 100:
        feats.add("fp4")
    return frozenset(feats)


def _absent(reason: str) -> DeviceInfo:
    return DeviceInfo(target="cuda", device_type="cuda", available=False, reason=reason,
                      vendor=CAPS.vendor, dist_backend=CAPS.dist_backend)


def probe() -> DeviceInfo:
    """Describe device 0 and count the visible devices; unavailable (with a reason) otherwise."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is a reason, not a crash
        return _absent(f"torch cannot be imported ({type(exc).__name__}: {exc})")
    hip = getattr(torch.version, "hip", None)
    if hip:
        return _absent(f"torch is a ROCm build (torch.version.hip={hip}); use the rocm target")
    cuda_version = getattr(torch.version, "cuda", None)
    if cuda_version is None:
        return _absent("torch was built without CUDA (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        return _absent(f"no CUDA device: torch.cuda.is_available() is False "
                       f"(torch built with CUDA {cuda_version})")
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    capability = props.major * 10 + props.minor
    extra: dict[str, object] = {"torch_cuda": cuda_version,
                                "multiprocessors": props.multi_processor_count}
    # Mixed GPUs in one host are rare but real; the plan is made for device 0, so say so.
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    if len(set(names)) > 1:
        extra["devices"] = names
    return DeviceInfo(
        target="cuda",
        device_type="cuda",
        available=True,
        name=props.name,
        vendor=CAPS.vendor,
        count=count,
        arch=f"sm{capability}",
        capability=capability,
        memory_bytes=int(props.total_memory),
        features=features_for(capability),
        dist_backend=CAPS.dist_backend,
        extra=extra,
    )


@hookimpl
def core_register_hardware(register):
    register("cuda", CAPS, probe, platform="plugins.hardware.gpu:TorchCudaPlatform")
