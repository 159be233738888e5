"""Defaults derived from the device's memory (issue 6): prefill chunk and the static fraction."""

from __future__ import annotations

import pytest

from core.contract.platform import ModelGeometry
from plugins.hardware.cpu_runtime import CpuPlatform
from plugins.hardware.gpu import gpu_memory_defaults

GiB = 2**30


@pytest.fixture
def llama8b(model_spec):
    s = model_spec("llama-3.1-8b")
    return ModelGeometry(hidden_size=s.hidden_size, num_heads=s.num_heads,
                         num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                         intermediate_size=14336, vocab_size=s.vocab_size, dtype_bytes=2)


def memory_defaults(total, geometry):
    d = gpu_memory_defaults(total, geometry)
    return d.chunked_prefill_size, d.mem_fraction_static, d.note


def test_bigger_devices_get_bigger_chunks_and_keep_enough_free(llama8b):
    rows = [(gib, *memory_defaults(gib * GiB, llama8b)[:2])
            for gib in (16, 24, 48, 80, 141)]
    chunks = [c for _, c, _ in rows]
    assert chunks == sorted(chunks) and chunks[0] == 2048 and chunks[-1] == 16384
    for gib, chunk, fraction in rows:
        assert 0.5 <= fraction <= 0.9
        left = gib * GiB * (1 - fraction)
        # what is left outside the static part holds one chunk's widest activations (bf16)
        assert left >= chunk * (3 * 14336 + 6144 + 4 * 4096) * 2, (gib, chunk, fraction)
    # an H200 keeps ~10% for activations, not the 15% a one-size default would
    assert rows[-1][2] == 0.9


def test_the_note_says_where_the_numbers_came_from(llama8b):
    chunk, fraction, note = memory_defaults(80 * GiB, llama8b)
    assert f"chunked prefill {chunk}" in note and f"mem fraction {fraction}" in note
    assert "80 GiB" in note


def test_cpu_keeps_its_own_defaults(llama8b):
    from plugins.hardware import cpu

    d = CpuPlatform(cpu.probe()).memory_defaults(512 * GiB, llama8b)
    assert (d.chunked_prefill_size, d.mem_fraction_static, d.max_running_requests,
            d.kv_cap_tokens, d.graph_max_bs) == (2048, 0.5, 64, 32768, 8)
    assert "CPU defaults" in d.note


def test_plan_memory_is_a_function_of_flags_device_and_platform(model_spec):
    """The worker's first phase: no device is touched; the same inputs give the same plan."""
    from types import SimpleNamespace

    from core.engine.worker import plan_memory
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve
    from plugins.hardware.gpu import TorchCudaPlatform

    spec = model_spec("llama-3.1-8b")
    h200 = PROFILES["h200"]
    plan = resolve(spec, h200, ServerArgs(attention_backend="torch_native",
                                          disable_cuda_graph=True), build_registry())
    platform = TorchCudaPlatform(h200)
    cfg = SimpleNamespace(intermediate_size=14336)
    per_token = 128 * 1024  # bf16 K+V of 32 layers x 8 heads x 128
    mem = plan_memory(ServerArgs(), plan, spec, cfg, 2, per_token, 120 * GiB, platform)
    assert mem.chunked_prefill_size == 16384 and mem.max_running == 256
    assert not mem.graphs.enabled and "graph capture off" in mem.graphs.note
    assert mem.notes[0].startswith("from 140 GiB of device memory")
    assert mem.kv_tokens > 0 and mem == plan_memory(ServerArgs(), plan, spec, cfg, 2, per_token,
                                                    120 * GiB, platform)
    fixed = plan_memory(ServerArgs(max_total_tokens=4096, chunked_prefill_size=-1), plan, spec,
                        cfg, 2, per_token, 0, platform)
    assert fixed.kv_tokens == 4096 and fixed.chunked_prefill_size is None


# -- the KV pool on a shared host (issue 32 item 5) ------------------------------------------------

MiB = 2**20


def _cpu_plan_memory(model_spec, free_bytes, **args):
    """plan_memory for llama-3.1-8b on the x86-cpu profile with the CPU platform: (MemoryPlan,
    bytes per token). free_bytes: what the worker passes (this process's share of the host's
    available memory)."""
    from types import SimpleNamespace

    from core.engine.worker import plan_memory
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve

    spec = model_spec("llama-3.1-8b")
    cpu = PROFILES["x86-cpu"]
    plan = resolve(spec, cpu, ServerArgs(attention_backend="torch_native"), build_registry())
    per_token = 128 * 1024
    mem = plan_memory(ServerArgs(**args), plan, spec, SimpleNamespace(intermediate_size=14336),
                      2, per_token, free_bytes, CpuPlatform(cpu))
    return mem, per_token


def test_cpu_kv_pool_is_what_the_model_needs_not_a_share_of_all_ram(model_spec):
    """Plenty of memory: the default pool (32768 tokens), whatever the host's total."""
    mem, _ = _cpu_plan_memory(model_spec, 64 * GiB)
    assert mem.kv_tokens == 32768
    assert "the default for host memory" in mem.notes[1], mem.notes


def test_cpu_kv_pool_on_a_busy_host_starts_smaller_and_says_so(model_spec):
    """The outside tester's host: 6739 MiB available of 24105 MiB, `--tp-size 3` (each rank gets
    a third). The old rule counted every other process's memory as the engine's (free - total x
    (1 - 0.5) < 0) and refused to start; now each rank takes 0.5 of its share."""
    share = 6739 * MiB // 3
    mem, per_token = _cpu_plan_memory(model_spec, share)
    assert mem.kv_tokens == int(share * 0.5) // per_token == 8985
    note = mem.notes[1]
    assert "fewer than the default 32768" in note and "host memory is short" in note, note
    assert "2246 MiB" in note and "--max-total-tokens" in note
    # the flag is a share of what is available, and says so
    mem, _ = _cpu_plan_memory(model_spec, share, mem_fraction_static=0.25)
    assert mem.kv_tokens == int(share * 0.25) // per_token
    assert "--mem-fraction-static 0.25 of the 2246 MiB" in mem.notes[1], mem.notes[1]
    # --max-total-tokens is taken as given
    mem, _ = _cpu_plan_memory(model_spec, 0, max_total_tokens=4096)
    assert mem.kv_tokens == 4096


def test_cpu_kv_pool_refuses_only_below_two_pages(model_spec):
    with pytest.raises(ValueError, match=r"no memory left for the KV cache: .*available to this "
                                         r"engine process.*set --max-total-tokens"):
        _cpu_plan_memory(model_spec, 256 * 1024)
