"""What the plugin-kind conformance suites share when they parametrize: the suite devices, the
selected plugins, and the skips that say why one does not run.

`suite_params(config, kind, option, label, cases)` walks every suite device
(--conformance-device, else cpu plus cuda when present) and every selected plugin of `kind`
(those named with the suite's option, else every registered one; conformance.plugin
.named_plugins) and hands each plugin that can run on a device to the suite's `cases(Target)`,
which returns that plugin's pytest params (its cases, and the `not-covered` skips of a named one).
What cannot run becomes one skipped param saying why, when the user asked for it:

- an absent device: `<device>-unavailable` ("device <device>: <torch's error>"), or, with
  `device_skip=False`, one `<name>-<device>` skip per named plugin with torch's error;
- a plugin the suite does not take (`declines(reg)` returns a reason): `<name>-<device>`;
- a plugin that cannot run there (conformance.attention_check.unavailable_reasons):
  `<name>-<device>`, "<name> cannot run on <device>: <reasons>" (`say_device=False`: the
  reasons alone).

Cases off the CPU carry the `gpu` mark (Target.marks). Unnamed plugins that cannot run are left
out silently: a run over every registered plugin checks what each one can do here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch

from conformance.attention_check import device_target, unavailable_reasons
from conformance.plugin import named_plugins
from core.contract.capabilities import DeviceInfo

if TYPE_CHECKING:
    from core.plan.registry import Registration, Registry

__all__ = ["Target", "default_devices", "device_info", "device_missing", "skip_param",
           "suite_params"]


def default_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_info(registry: Registry, device: torch.device) -> DeviceInfo:
    """The hardware plugin's probe of `device`'s target, or a bare DeviceInfo without one."""
    target = device_target(device)
    if target in registry.kind("hardware"):
        return registry.probe(target)
    return DeviceInfo(target=target, device_type=device.type)


def device_missing(device: torch.device) -> str:
    """Why tensors cannot be made on `device` ("" when they can)."""
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch raises either for absent devices
        return str(exc).splitlines()[0]
    return ""


@dataclass(frozen=True)
class Target:
    """One selected plugin that can run on one suite device, with the suite's options."""

    name: str
    reg: Registration
    device_name: str  # as given (--conformance-device), for ids
    device: torch.device
    marks: tuple[Any, ...]  # (pytest.mark.gpu,) off the CPU
    named: bool  # named with the suite's option: the suite then says what it does not cover
    full: bool  # --conformance-full
    seed: int  # --conformance-seed


def skip_param(id: str, reason: str, marks: Iterable[Any] = (), width: int = 1):
    """A skipped pytest param of `width` values (None: never used), with `marks` kept."""
    return pytest.param(*([None] * width), id=id,
                        marks=[*marks, pytest.mark.skip(reason=reason)])


def suite_params(config: pytest.Config, kind: str, option: str, label: str,
                 cases: Callable[[Target], Iterable[Any]], *, width: int = 1,
                 device_skip: bool = True, say_device: bool = True,
                 declines: Callable[[Registration], str | None] | None = None) -> list:
    """The suite's pytest params, in device order then plugin order (see the module doc).
    `option` is the dest of the suite's --conformance-... option, `label` what its plugins are
    called in errors; `width` the number of values of each param (for the skips)."""
    registry, plugins, named = named_plugins(config, kind, option, label)
    devices = config.getoption("conformance_device", default=None) or default_devices()
    full = bool(config.getoption("conformance_full", default=False))
    seed = int(config.getoption("conformance_seed", default=0) or 0)
    params: list = []
    for device_name in devices:
        device = torch.device(device_name)
        marks = () if device.type == "cpu" else (pytest.mark.gpu,)
        missing = device_missing(device)
        if missing and device_skip:
            params.append(skip_param(f"{device_name}-unavailable",
                                     f"device {device_name}: {missing}", marks, width))
            continue
        info = device_info(registry, device) if not missing else None
        for name in named or sorted(plugins):
            reg = plugins[name]
            asked = name in named  # asked for by name: say why it does not run
            declined = declines(reg) if declines is not None else None
            if declined:
                if asked:
                    params.append(skip_param(f"{name}-{device_name}", declined, marks, width))
                continue
            why = [missing] if missing else unavailable_reasons(reg, device, info)
            if why:
                if asked:
                    reason = "; ".join(why)
                    if say_device:
                        reason = f"{name} cannot run on {device_name}: {reason}"
                    params.append(skip_param(f"{name}-{device_name}", reason, marks, width))
                continue
            params.extend(cases(Target(name, reg, device_name, device, marks, asked, full,
                                       seed)))
    return params
