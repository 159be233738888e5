"""`example_accel`: a teaching accelerator, to show how a hardware target plugin is written.

This is an example, not a device driver. There is no accelerator: when enabled, the "device" is
the host CPU (torch device_type "cpu") under another name, with a runtime of its own. Two parts:

- the probe, which keeps the contract every hardware probe keeps: it never raises for absent
  hardware, it returns a DeviceInfo with available=False and a reason a person can act on;
- the Platform (core/contract/platform.py), which the engine asks everything a device does differently
  at run time: memory, defaults, copies, graphs, post-load transforms, overlap. The engine runs
  on this target end to end with no change to core-serve (`core serve --device example_accel`).
"""

from __future__ import annotations

import os
from typing import Any

from core.contract.capabilities import DeviceInfo
from core.contract.platform import BasePlatform, GraphSupport, MemoryDefaults, ModelGeometry

ENABLE_ENV = "CORE_EXAMPLE_ACCEL"


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every OS has these names
        return 0


def probe() -> DeviceInfo:
    """Report the example accelerator: unavailable unless CORE_EXAMPLE_ACCEL=1."""
    if os.environ.get(ENABLE_ENV, "").strip() != "1":
        return DeviceInfo(
            target="example_accel", device_type="cpu", available=False,
            reason=f"simulated example accelerator; set {ENABLE_ENV}=1 to enable it",
        )
    return DeviceInfo(
        target="example_accel",
        device_type="cpu",
        available=True,
        name="Example Accelerator",
        vendor="Example",
        count=1,
        arch="example-v1",
        memory_bytes=_host_memory_bytes(),
        features={"fp16", "bf16"},
        dist_backend="gloo",
        # Not simulated: the engine really runs here (on the host CPU under another name).
        extra={"note": "teaching example; runs on the host CPU"},
    )


class ExampleAccelPlatform(BasePlatform):
    """The example target's runtime: a BasePlatform subclass that overrides only what this
    device does differently (its memory figures and defaults, its notes). Everything else is
    BasePlatform's default: tensors on "cpu" (its device_type), synchronous copies, no graph
    runner, no warm-up, gloo."""

    KV_TOKENS = 8192  # at most this many tokens of KV cache unless --max-total-tokens says

    def memory(self, index: int = 0) -> tuple[int, int]:
        total = self.info.memory_bytes
        return total * 3 // 4, total  # a teaching figure: three quarters of the host are "free"

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        return MemoryDefaults(chunked_prefill_size=512, mem_fraction_static=0.6,
                              max_running_requests=8, kv_cap_tokens=self.KV_TOKENS,
                              graph_max_bs=0,
                              note="example_accel defaults: chunked prefill 512, 8 running "
                                   f"requests, KV cache at most {self.KV_TOKENS} tokens")

    def graphs(self) -> GraphSupport:
        return GraphSupport(False, "example_accel captures no graphs (a teaching target)")

    def post_load(self, model: Any) -> list[str]:
        return ["example_accel: weights left in the checkpoint's layout"]

    def overlap_schedule(self) -> tuple[bool, str]:
        return False, "overlap schedule off: example_accel computes on the host thread"
