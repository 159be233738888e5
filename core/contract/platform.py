"""The Platform protocol: a hardware target's runtime, as the engine uses it.

A hardware plugin registers a Platform beside its probe:

    register("cuda", HardwareCaps(...), probe, platform="plugins.hardware.gpu:CudaPlatform")

The factory is lazy, like every other: it is imported and called (with the probe's DeviceInfo)
only in the process that runs on that target. The engine asks the Platform everything a device
does differently at run time; core modules past this one name no device type and import no vendor
library. A target that registers no Platform runs on `GenericPlatform` (memory through
`torch.<device_type>.mem_get_info`, no graphs, no overlap) and the engine's notes say so.

Every method is called on the engine worker's thread. What a Platform may assume: torch is
importable and its device type exists in this process (the probe said available=True).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from core.contract.capabilities import DeviceInfo

GiB = 2**30


@dataclass(frozen=True)
class MemoryDefaults:
    """Settings the user left open, from the device's memory, with the note that explains them.

    kv_cap_tokens: an upper bound on the KV pool when it is sized from memory (None: none).
    graph_max_bs: the largest decode batch worth capturing as a graph (0: no graphs).
    """

    chunked_prefill_size: int
    mem_fraction_static: float
    max_running_requests: int
    kv_cap_tokens: int | None
    graph_max_bs: int
    note: str


@dataclass(frozen=True)
class GraphSupport:
    """Whether this platform can capture decode graphs, and why not when it cannot."""

    available: bool
    reason: str = ""


@runtime_checkable
class Platform(Protocol):
    """One device target's runtime. `info` is the DeviceInfo its probe returned."""

    info: DeviceInfo

    def torch_device(self, index: int = 0) -> str:
        """The torch device string for device `index` ("cuda:0", "cpu")."""
        ...

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device `index` now."""
        ...

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        """Defaults for chunked prefill, static memory fraction, max running requests, the KV
        cap and graph batch sizes, from the device's total memory and the model's geometry."""
        ...

    def to_device(self, host: Any, device: Any) -> Any:
        """A host tensor on the device; non-blocking (pinned) where that keeps the host ahead of
        the device. The host tensor must not be reused by the caller afterwards."""
        ...

    def copy_to_host(self, tensor: Any) -> tuple[Any, Any]:
        """Start copying a device tensor to the host: (host tensor, waiter); `waiter` is None when
        the copy is already complete, else an object whose `synchronize()` blocks until it is."""
        ...

    def synchronize(self, device: Any) -> None:
        """Block until the device has finished all queued work."""
        ...

    def graphs(self) -> GraphSupport:
        """Whether decode graphs can be captured here (the reason when not)."""
        ...

    def graph_runner(self, runner: Any, sizes: Any, vocab_size: int) -> Any:
        """A graph runner for `runner` (core.engine.model_runner.ModelRunner) at batch `sizes`, with
        `capture()`, `can_run(bs)`, `decode(...)` and a `graphs` dict; only called when
        `graphs().available`."""
        ...

    def post_load(self, model: Any) -> list[str]:
        """Transform a loaded model for this device once loading is over (weight layouts its
        kernels stream fastest); returns notes for the engine's log."""
        ...

    def overlap_schedule(self) -> tuple[bool, str]:
        """Whether launching step N+1 before reading step N's tokens helps here, and why."""
        ...

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(requests, tokens) extend shapes to run once at startup so kernels compile then."""
        ...

    def dist_backend(self) -> str:
        """The torch.distributed backend of this target (nccl, gloo, xccl, hccl, ...)."""
        ...


@dataclass(frozen=True)
class ModelGeometry:
    """What memory defaults depend on (from core.plan.model_spec.ModelSpec)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    vocab_size: int
    dtype_bytes: int


class GenericPlatform:
    """For a target that registered no Platform: memory through `torch.<type>.mem_get_info`,
    conservative defaults, synchronous copies, no graphs, no overlap."""

    def __init__(self, info: DeviceInfo):
        self.info = info

    def torch_device(self, index: int = 0) -> str:
        return "cpu" if self.info.device_type == "cpu" else f"{self.info.device_type}:{index}"

    def _module(self) -> Any:
        import torch

        module = getattr(torch, self.info.device_type, None)
        if module is None or not hasattr(module, "mem_get_info"):
            raise ValueError(f"cannot query the memory of device type {self.info.device_type!r}:"
                             f" torch.{self.info.device_type}.mem_get_info does not exist; the "
                             f"hardware plugin {self.info.target!r} should register a Platform")
        return module

    def memory(self, index: int = 0) -> tuple[int, int]:
        free, total = self._module().mem_get_info(index)
        return int(free), int(total)

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        return MemoryDefaults(2048, 0.8, 64, None, 0, "generic platform defaults (the target "
                              f"{self.info.target!r} registers no Platform): chunked prefill "
                              "2048, mem fraction 0.8, 64 running requests")

    def to_device(self, host: Any, device: Any) -> Any:
        return host.to(device)

    def copy_to_host(self, tensor: Any) -> tuple[Any, Any]:
        return tensor.to("cpu"), None

    def synchronize(self, device: Any) -> None:
        return None

    def graphs(self) -> GraphSupport:
        return GraphSupport(False, f"target {self.info.target!r} registers no Platform with "
                                   "graph capture")

    def graph_runner(self, runner: Any, sizes: Any, vocab_size: int) -> Any:
        raise RuntimeError("GenericPlatform has no graph runner")

    def post_load(self, model: Any) -> list[str]:
        return []

    def overlap_schedule(self) -> tuple[bool, str]:
        return False, f"target {self.info.target!r} registers no Platform saying it overlaps"

    def warmup_shapes(self) -> list[tuple[int, int]]:
        return []

    def dist_backend(self) -> str:
        return self.info.dist_backend or "gloo"


def load_platform(registry: Any, info: DeviceInfo) -> Platform:
    """The Platform of the target that produced `info` (GenericPlatform when none registered)."""
    reg = registry.get("hardware", info.target)
    factory = getattr(reg, "platform", None) if reg is not None else None
    if factory is None:
        return GenericPlatform(info)
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        factory = obj
    platform = factory(info)
    missing = [m for m in ("memory", "memory_defaults", "to_device", "copy_to_host",
                           "synchronize", "graphs", "post_load", "overlap_schedule",
                           "warmup_shapes", "torch_device") if not hasattr(platform, m)]
    if missing:
        raise TypeError(f"the Platform of hardware target {info.target!r} lacks "
                        f"{', '.join(missing)} (see core/contract/platform.py)")
    return platform


def with_graph_support(registry: Any, info: DeviceInfo) -> DeviceInfo:
    """`info` with `graph_capture` set from its target's Platform.graphs(): the one source of
    graph ability (probes and profiles do not decide it; a target without a Platform has none)."""
    if not info.available:
        return info
    available = bool(load_platform(registry, info).graphs().available)
    if available == info.graph_capture:
        return info
    return dataclasses.replace(info, graph_capture=available)


def platform_for_device(device: Any) -> Platform:
    """The Platform of the available registered target whose torch device type `device` has
    (for in-process use: tests and tools that build a ModelRunner by hand)."""
    from core.plan.registry import get_registry

    registry = get_registry()
    for name, reg in registry.kind("hardware").items():
        if reg.caps.device_type == device.type:
            info = registry.probe(name)
            if info.available:
                return load_platform(registry, info)
    raise ValueError(f"no available hardware target runs torch device type {device.type!r}")
