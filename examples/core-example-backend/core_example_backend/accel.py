"""`example_accel`: a simulated accelerator, to show how a hardware target plugin is written.

This is a teaching example, not a device driver. There is no accelerator: when enabled, the
"device" is the host CPU (device_type "cpu") under another name. The probe follows the contract
every hardware probe keeps: it never raises for absent hardware, it returns a DeviceInfo with
available=False and a reason a person can act on.
"""

from __future__ import annotations

import os

from core.capabilities import DeviceInfo

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
        graph_capture=False,
        # Nothing was detected: it is the host CPU under another name.
        simulated=True,
        extra={"note": "teaching example; runs on the host CPU"},
    )
