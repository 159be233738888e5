"""The runtime of the `xpu` (Intel, torch.xpu) and `npu` (Ascend, torch_npu's torch.npu) targets.

Written from those modules' documented APIs and NOT run here (no such device in this project's
machines): memory through `torch.<type>.mem_get_info`, the GPU memory defaults without graph
sizes, plain non-blocking copies, no graph capture and no overlap schedule until someone with the
hardware checks them. A vendor package can register a fuller Platform under its own target name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from core.contract.capabilities import DeviceInfo
from core.contract.platform import GraphSupport, MemoryDefaults, ModelGeometry
from plugins.hardware.gpu import gpu_memory_defaults


class TorchAccelPlatform:
    """core.contract.platform.Platform over torch.<device_type> for accelerators checked by nobody here."""

    module_name = ""  # the torch attribute: "xpu", "npu"
    imports: tuple[str, ...] = ()  # extensions that attach that attribute (torch_npu)

    def __init__(self, info: DeviceInfo):
        self.info = info

    def _module(self) -> Any:
        import torch

        for name in self.imports:
            importlib.import_module(name)
        return getattr(torch, self.module_name)

    def torch_device(self, index: int = 0) -> str:
        return f"{self.info.device_type}:{index}"

    def memory(self, index: int = 0) -> tuple[int, int]:
        free, total = self._module().mem_get_info(index)
        return int(free), int(total)

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        d = gpu_memory_defaults(total_bytes, geometry)
        return dataclasses.replace(d, graph_max_bs=0, note=d.note + f" ({self.info.target}: "
                                   "GPU defaults, not tuned on this hardware)")

    def to_device(self, host: Any, device: Any) -> Any:
        return host.to(device, non_blocking=True)

    def copy_to_host(self, tensor: Any) -> tuple[Any, Any]:
        return tensor.to("cpu"), None  # synchronous: the overlap schedule is off here

    def synchronize(self, device: Any) -> None:
        self._module().synchronize(device)

    def graphs(self) -> GraphSupport:
        return GraphSupport(False, f"{self.info.target}: graph capture is not implemented for "
                                   "this target")

    def graph_runner(self, runner: Any, sizes: Any, vocab_size: int) -> Any:
        raise RuntimeError(f"{self.info.target} has no graph runner")

    def post_load(self, model: Any) -> list[str]:
        return []

    def overlap_schedule(self) -> tuple[bool, str]:
        return False, (f"overlap schedule off: not checked on {self.info.target} (its copies "
                       "here are synchronous)")

    def warmup_shapes(self) -> list[tuple[int, int]]:
        return []

    def dist_backend(self) -> str:
        return self.info.dist_backend


class XpuPlatform(TorchAccelPlatform):
    module_name = "xpu"


class NpuPlatform(TorchAccelPlatform):
    module_name = "npu"
    imports = ("torch_npu",)  # attaches torch.npu
