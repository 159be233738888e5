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

from core.contract.platform import BasePlatform, MemoryDefaults, ModelGeometry
from plugins.hardware.gpu import gpu_memory_defaults


class TorchAccelPlatform(BasePlatform):
    """The Platform over torch.<device_type> for accelerators checked by nobody here: the GPU
    memory defaults without graphs, non-blocking copies to the device. Devices "<type>:N", no
    graphs, no warm-up and the backend's device binding are BasePlatform's defaults; what
    touches torch.<type> first imports the extensions that attach it."""

    module_name = ""  # the torch attribute: "xpu", "npu"
    imports: tuple[str, ...] = ()  # extensions that attach that attribute (torch_npu)

    def _module(self) -> Any:
        import torch

        for name in self.imports:
            importlib.import_module(name)
        return getattr(torch, self.module_name)

    def memory(self, index: int = 0) -> tuple[int, int]:
        free, total = self._module().mem_get_info(index)
        return int(free), int(total)

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        d = gpu_memory_defaults(total_bytes, geometry)
        return dataclasses.replace(d, graph_max_bs=0, note=d.note + f" ({self.info.target}: "
                                   "GPU defaults, not tuned on this hardware)")

    def to_device(self, host: Any, device: Any) -> Any:
        return host.to(device, non_blocking=True)

    def synchronize(self, device: Any) -> None:
        self._module().synchronize(device)

    def overlap_schedule(self) -> tuple[bool, str]:
        return False, (f"overlap schedule off: not checked on {self.info.target} (its copies "
                       "here are synchronous)")

    def dist_bind(self, device: Any) -> dict[str, Any]:
        self._module()  # torch.npu exists once torch_npu is imported
        return super().dist_bind(device)


class XpuPlatform(TorchAccelPlatform):
    module_name = "xpu"


class NpuPlatform(TorchAccelPlatform):
    module_name = "npu"
    imports = ("torch_npu",)  # attaches torch.npu
