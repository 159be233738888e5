"""The Platform: a hardware target's runtime, as the engine uses it.

A hardware plugin registers a Platform beside its probe:

    register("cuda", HardwareCaps(...), probe, platform="plugins.hardware.gpu:TorchCudaPlatform")

A Platform is a subclass of `BasePlatform`, whose every member is real: the default is what a
device that does nothing special does, and a target overrides only what its device does
differently. The engine calls the members; it never probes for them. The reference is checked
when the plugin registers (through the registry's one "module:attr" loader, so the platform's
module is imported then: it imports no vendor library at module level, only inside methods, as a
probe does): anything but a BasePlatform subclass, or a factory, is refused with the reason, and
`core backends` lists it. The platform is built (called with the probe's DeviceInfo) only in the
processes that run on, or plan for, that target; a factory that builds something else is refused
there. A target that registers no Platform runs on `GenericPlatform` (the defaults) and the
engine's notes say so. Core modules past this one name no device type: what a device does
differently is asked here.

Every method is called on the engine worker's thread. What a Platform may assume: torch is
importable and its device type exists in this process (the probe said available=True), except in
`__init__`, `graphs`, `dist_backend` and `torch_device`, which the planner and the client process
also call, for simulated devices too: those touch no device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from core.contract.capabilities import DeviceInfo

if TYPE_CHECKING:  # the planner imports this module and no torch
    import torch
    from torch import nn

    from core.contract.graphs import GraphRunner
    from core.engine.model_runner import ModelRunner
    from core.plan.registry import Registry

GiB = 2**30


class CopyWaiter(Protocol):
    """What `copy_to_host` returns for a copy still in flight (a device event, a stream)."""

    def synchronize(self) -> None:
        """Block until the copy is complete."""


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


class BasePlatform:
    """One device target's runtime. `info` is the DeviceInfo its probe returned.

    Each member's default is that of a device with nothing special to do: memory through
    `torch.<device_type>.mem_get_info`, generic memory defaults, KV buffers from torch.zeros,
    plain synchronous copies, no graphs, no post-load transform, no overlap, no warm-up, and
    torch.distributed with the target's backend (gloo over the host). Override what differs."""

    # Why a default applies, as the notes that report one say it (GenericPlatform: no Platform).
    default_reason = "its Platform keeps BasePlatform's default"

    def __init__(self, info: DeviceInfo):
        self.info = info

    # ---- devices and memory ----

    def torch_device(self, index: int = 0) -> str:
        """The torch device string of device `index` ("cuda:0", "xpu:1"); a target whose device
        is the host answers the host device ("cpu"), which has no index."""
        host = self.host_device()
        return host if self.info.device_type == host else f"{self.info.device_type}:{index}"

    def host_device(self) -> str:
        """torch's device for host memory: where checkpoint tensors are read into before they
        move to the device, where copies to the host land, where gloo's collectives run.
        Default "cpu", torch's one host device."""
        return "cpu"

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device `index` now. Default: torch.<device_type>.mem_get_info."""
        import torch

        kind = self.info.device_type
        try:
            query = torch.get_device_module(kind).mem_get_info
        except (AttributeError, RuntimeError) as exc:  # no such module, or no such function
            raise ValueError(f"cannot query the memory of device type {kind!r} through "
                             f"torch.{kind}.mem_get_info ({type(exc).__name__}: {exc}); target "
                             f"{self.info.target!r} needs a Platform whose memory() answers "
                             f"({self.default_reason})") from exc
        free, total = query(index)
        return int(free), int(total)

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry | None) -> MemoryDefaults:
        """Defaults for chunked prefill, static memory fraction, max running requests, the KV
        cap and graph batch sizes, from the device's total memory and the model's geometry.
        Default: chunked prefill 2048, fraction 0.8, 64 running requests, no cap, no graphs."""
        return MemoryDefaults(2048, 0.8, 64, None, 0,
                              f"generic defaults for target {self.info.target!r} "
                              f"({self.default_reason}): chunked prefill 2048, mem fraction "
                              f"0.8, 64 running requests")

    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
        """A zero-filled buffer on `device` for a large, long-lived allocation (the KV pool's
        per-layer K and V). Default torch.zeros; a platform may allocate so that pages nobody
        has touched cost nothing yet (the cpu target: calloc)."""
        import torch

        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    # ---- copies ----

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor on the device; non-blocking (pinned) where that keeps the host ahead of
        the device. The caller does not reuse the host tensor afterwards. Default: a plain
        (synchronous) `host.to(device)`."""
        return host.to(device)

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, CopyWaiter | None]:
        """Start copying a device tensor to the host: (host tensor, waiter); `waiter` is None when
        the copy is already complete, else an object whose `synchronize()` blocks until it is.
        Default: a synchronous copy, no waiter."""
        return tensor.to(self.host_device()), None

    def synchronize(self, device: torch.device) -> None:
        """Block until the device has finished all queued work. Default: nothing is queued (a
        device whose work is done when its call returns)."""
        return None

    # ---- graphs, weights, scheduling ----

    def graphs(self) -> GraphSupport:
        """Whether decode graphs can be captured here, and why not when they cannot (the one
        source of graph ability: probes and profiles do not decide it). Default: none."""
        return GraphSupport(False, f"target {self.info.target!r} captures no decode graphs "
                                   f"({self.default_reason})")

    def graph_runner(self, runner: ModelRunner, sizes: Sequence[int], vocab_size: int
                     ) -> GraphRunner:
        """A graph runner (a core.contract.graphs.GraphRunner subclass with `capture`) for
        `runner` (core.engine.model_runner.ModelRunner) at batch `sizes`; only called when
        `graphs().available`. Default: refused, as graphs() says none."""
        raise RuntimeError(f"target {self.info.target!r} has no graph runner: graph_runner() is "
                           f"called only when graphs().available ({self.default_reason})")

    def post_load(self, model: nn.Module) -> list[str]:
        """Transform a loaded model for this device once loading is over (weight layouts its
        kernels stream fastest; outputs unchanged within rounding); returns notes for the
        engine's log. Default: the model as loaded, no notes."""
        return []

    def overlap_schedule(self) -> tuple[bool, str]:
        """Whether launching step N+1 before reading step N's tokens helps here, and why.
        Default: off (copies are synchronous, nothing to overlap)."""
        return False, (f"overlap schedule off: target {self.info.target!r} does not say it "
                       f"overlaps ({self.default_reason})")

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(requests, tokens) extend shapes to run once at startup so kernels compile then.
        Default: none."""
        return []

    # ---- tensor-parallel ranks (core/engine/distributed.py) ----

    def dist_backend(self) -> str:
        """The torch.distributed backend of this target (nccl, gloo, xccl, hccl, ...). Default:
        the probe's `dist_backend`, else gloo."""
        return self.info.dist_backend or "gloo"

    def dist_bind(self, device: torch.device) -> dict[str, Any]:
        """Make `device` this rank's device before it joins the process group; returns extra
        keywords for torch.distributed.init_process_group. Default: a backend with one device
        per rank (all but gloo) sets the current device and passes it as `device_id`; gloo
        binds nothing."""
        if self.dist_backend() == "gloo":
            return {}
        import torch

        torch.get_device_module(device).set_device(device)
        return {"device_id": device}

    def dist_device(self, device: torch.device) -> torch.device:
        """Where the worker's own collectives' tensors live (rank 0's messages, the agreed pool
        size) for a rank on `device`. Default: the host for gloo, else `device`."""
        if self.dist_backend() != "gloo":
            return device
        import torch

        return torch.device(self.host_device())


# The name the engine and plugins annotate with; there is one class to subclass.
Platform = BasePlatform


class GenericPlatform(BasePlatform):
    """What a target that registered no Platform runs on: BasePlatform's defaults, with notes
    saying that is why."""

    default_reason = "it registers no Platform"


def platform_problem(obj: object) -> str | None:
    """Why `obj` cannot be registered as a hardware target's platform (None: it can). A class
    must subclass BasePlatform; any other callable is a factory, whose product load_platform
    checks; anything else is refused."""
    if isinstance(obj, type):
        if issubclass(obj, BasePlatform):
            return None
        return (f"{obj.__module__}.{obj.__qualname__} is not a subclass of "
                f"core.contract.platform.BasePlatform (subclass it and override only what the "
                f"device does differently)")
    if isinstance(obj, BasePlatform):
        return (f"an instance of {type(obj).__qualname__} was given: register its class (it is "
                f"called with the probe's DeviceInfo)")
    if not callable(obj):
        return f"{obj!r} is neither a BasePlatform subclass nor a factory of one"
    return None


def load_platform(registry: Registry, info: DeviceInfo) -> BasePlatform:
    """The Platform of the target that produced `info` (GenericPlatform when none registered).
    The registry checked the registered class at registration; a factory's product is checked
    here."""
    reg = registry.get("hardware", info.target)
    factory: Callable[[DeviceInfo], object] | None = reg.platform if reg is not None else None
    if factory is None:
        return GenericPlatform(info)
    platform = factory(info)
    if not isinstance(platform, BasePlatform):
        raise TypeError(f"the platform factory of hardware target {info.target!r} "
                        f"({reg.origin.describe()}) returned {type(platform).__qualname__}, not "
                        f"a core.contract.platform.BasePlatform")
    return platform


def with_graph_support(registry: Registry, info: DeviceInfo) -> DeviceInfo:
    """`info` with `graph_capture` set from its target's Platform.graphs(): the one source of
    graph ability (probes and profiles do not decide it; a target without a Platform has none)."""
    if not info.available:
        return info
    available = bool(load_platform(registry, info).graphs().available)
    if available == info.graph_capture:
        return info
    return dataclasses.replace(info, graph_capture=available)


def platform_for_device(device: torch.device) -> Platform:
    """The Platform of the available registered target whose torch device type `device` has
    (for in-process use: tests and tools that build a ModelRunner or a KVPool by hand)."""
    from core.plan.registry import get_registry

    registry = get_registry()
    for name, reg in registry.kind("hardware").items():
        if reg.caps.device_type == device.type:
            info = registry.probe(name)
            if info.available:
                return load_platform(registry, info)
    raise ValueError(f"no available hardware target runs torch device type {device.type!r}")
