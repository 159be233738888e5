"""The Platform conformance tests (core/contract/platform.py) for a hardware target's runtime.

Collected by the conformance plugin (`pytest --conformance-platform TARGET`, see
conformance.plugin), or by importing them into a test module:

    from conformance.platform_suite import *  # noqa: F401,F403

Parametrization: every registered hardware target whose probe says it is available here (or only
those named; a named target that is unavailable is one skip with the probe's reason), times each
check below. The checks run on the device: the platform is a BasePlatform, memory figures, the
defaults and their note, the KV buffers' zeros (every dtype a KV cache takes), host<->device
copies both ways through the host device (the waiter honoured), graph support said with a reason
when off, the overlap answer, warmup shapes, the distributed backend and where its collectives
run, and the post-load transform on a tiny model (its output unchanged, within rounding).
"""

from __future__ import annotations

import pytest
import torch

from conformance.attention_suite import named_plugins
from core.contract.platform import (
    BasePlatform,
    GenericPlatform,
    GraphSupport,
    MemoryDefaults,
    ModelGeometry,
    load_platform,
)
from core.plan.registry import get_registry

__all__ = ["pytest_generate_tests", "test_platform_conformance"]

CHECKS = ("memory", "defaults", "zeros", "copies", "graphs", "overlap", "dist", "post_load")
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
GEOMETRY = ModelGeometry(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, dtype_bytes=2)


def platform_params(config: pytest.Config) -> list:
    registry, targets, named = named_plugins(config, "hardware", "conformance_platform",
                                             "hardware target")
    params = []
    for name in named or sorted(targets):
        info = registry.probe(name)
        if not info.available or info.simulated:
            if named:
                params.append(pytest.param(name, None, id=f"{name}-unavailable",
                                           marks=pytest.mark.skip(
                                               reason=info.reason or "simulated device")))
            continue
        marks = [] if info.device_type == "cpu" else [pytest.mark.gpu]
        params += [pytest.param(name, check, id=f"{name}-{check}", marks=marks)
                   for check in CHECKS]
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_platform_conformance":
        metafunc.parametrize("target,check", platform_params(metafunc.config))


def _tiny_model(device: torch.device) -> torch.nn.Module:
    from core.layers import Linear, ModelContext

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(64, [48, 16], True, ModelContext(device=device),
                               shard_names=("a", "b"))

        def forward(self, x):
            return self.proj(x)

    model = Tiny()
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return model


def test_platform_conformance(target, check):
    registry = get_registry()
    info = registry.probe(target)
    platform = load_platform(registry, info)
    if isinstance(platform, GenericPlatform):
        pytest.skip(f"{target} registers no Platform: the engine runs it on GenericPlatform")
    assert isinstance(platform, BasePlatform), type(platform)
    device = torch.device(platform.torch_device(0))
    assert device.type == info.device_type, (device, info.device_type)
    host_device = torch.device(platform.host_device())
    if check == "memory":
        free, total = platform.memory(0)
        assert isinstance(free, int) and isinstance(total, int)
        assert 0 < free <= total, (free, total)
    elif check == "defaults":
        d = platform.memory_defaults(info.memory_bytes or 16 * 2**30, GEOMETRY)
        assert isinstance(d, MemoryDefaults) and d.note.strip()
        assert d.chunked_prefill_size >= 1 and 0 < d.mem_fraction_static < 1
        assert d.max_running_requests >= 1 and d.graph_max_bs >= 0
        assert d.kv_cap_tokens is None or d.kv_cap_tokens >= 1
    elif check == "zeros":
        for dtype in KV_DTYPES:
            buf = platform.zeros((64, 2, 8), dtype, device)
            assert (buf.shape, buf.dtype, buf.device.type) == ((64, 2, 8), dtype, device.type)
            assert not buf.float().any(), f"{dtype} buffer is not zero"
            buf[3] = 1  # writable, and its own memory
            assert buf.float().sum().item() == 16
            assert not platform.zeros((64, 2, 8), dtype, device).float().any()
    elif check == "copies":
        host = torch.arange(1000, dtype=torch.long, device=host_device)
        dev = platform.to_device(host.clone(), device)
        assert dev.device.type == device.type
        back, waiter = platform.copy_to_host(dev * 2)
        if waiter is not None:
            waiter.synchronize()
        platform.synchronize(device)
        assert back.device == host_device and torch.equal(back, host * 2)
    elif check == "graphs":
        support = platform.graphs()
        assert isinstance(support, GraphSupport)
        assert support.available or support.reason.strip(), "graphs off must say why"
    elif check == "overlap":
        on, why = platform.overlap_schedule()
        assert isinstance(on, bool) and why.strip()
        shapes = platform.warmup_shapes()
        assert all(isinstance(n, int) and isinstance(t, int) and n >= 1 and t >= 1
                   for n, t in shapes), shapes
    elif check == "dist":
        assert isinstance(platform.dist_backend(), str) and platform.dist_backend()
        comm = platform.dist_device(device)
        assert isinstance(comm, torch.device) and comm in (device, host_device), comm
    elif check == "post_load":
        model = _tiny_model(device)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(device)
        with torch.inference_mode():
            want = model(x).float().cpu()
            notes = platform.post_load(model)
            got = model(x).float().cpu()
        assert isinstance(notes, list) and all(isinstance(n, str) for n in notes)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
