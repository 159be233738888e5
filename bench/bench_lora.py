"""LoRA backends' delta compared on identical inputs (pytest-benchmark): decode and prefill steps.

    pytest bench/bench_lora.py --benchmark-json=lora.json [--benchmark-group-by=group]

Shapes: Llama-3.1-8B's projections (qkv: 4096 -> 4096 + 1024 + 1024, gate_up: 4096 -> 2 x 14336,
down: 14336 -> 4096), 8 adapter slots of rank 16 (--max-lora-rank 16) on every one, at decode
(1, 8, 32, 64, 128, 256 tokens: one per request, requests' adapters round-robin over the 8, so
no two neighbours share one; a graph-safe backend is given these steps as the decode graphs give
them, device-only: core.contract.lora) and prefill (512 and 2048 tokens: 8 requests of equal
length, one per adapter) sizes. What is timed is one projection's `apply` (the delta added into y; `prepare`
once per step is left out: every projection of a step shares it), for:

- every registered LoRA backend that runs on this device (`torch_native`, the reference;
  `triton` on a CUDA GPU, skipped elsewhere with the reason);
- `per_adapter_loop`: the plain-torch peer, what PEFT does for a mixed batch: per adapter slot, a
  boolean mask of its tokens, x[mask] @ A^T @ B^T per output slice, scaled, added back.

On a CUDA GPU (bf16): CUDA events with L2 flushed before each call (ceilings.py), the copy
bandwidth measured in the same session. On a CPU (fp32, torch.set_num_threads(1) unless
CORE_BENCH_THREADS says otherwise): pytest-benchmark's wall clock, the copy bandwidth of a
256 MiB tensor copy measured in the same session and thread count. Each case's extra_info holds
GB/s over the bytes the delta must move at least (x; A and B of every adapter the step uses; y
read and written) against that copy bandwidth, and the speedup over the per-adapter loop. Every
implementation's result is checked against torch_native's before it is timed. A table is printed
at the end (CORE_BENCH_TABLE=path also writes it).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from ceilings import EventClock, emit_table

from core.contract.lora import LoRABatch, LoRAConfig, LoRAWeights
from core.plan.checks import check_device
from core.plan.registry import get_registry

SLOTS, RANK = 8, 16
HIDDEN, INTER, KV = 4096, 14336, 1024
# projection -> (in features, output slices)
PROJECTIONS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "gate_up": (HIDDEN, (INTER, INTER)),
               "down": (INTER, (HIDDEN,))}
DECODE = (1, 8, 32, 64, 128, 256)  # decode graphs' buckets go to 256 on an H200
PREFILL = (512, 2048)
PEER = "per_adapter_loop"
REFERENCE = "torch_native"

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _backends() -> list[str]:
    return sorted(get_registry().kind("lora"))


IMPLS = _backends() + [PEER]


def per_adapter_loop(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights,
                     token_slots: torch.Tensor) -> torch.Tensor:
    """The plain-torch peer (PEFT's mixed-batch forward): per slot, its tokens by a mask."""
    R = w.max_rank
    for s in range(w.a.shape[0]):
        mask = token_slots == s
        if not bool(mask.any()):
            continue
        xs = x[mask]
        parts, off = [], 0
        for j, width in enumerate(w.output_slices):
            parts.append((xs @ w.a[s, j * R:(j + 1) * R].T) @ w.b[s, off:off + width].T)
            off += width
        y[mask] += torch.cat(parts, dim=1) * w.scalings[s].to(x.dtype)
    return y


def segments(tokens: int) -> tuple[list[int], list[int]]:
    if tokens in DECODE:  # one token per request, adapters round-robin
        return [1] * tokens, [i % SLOTS for i in range(tokens)]
    return [tokens // SLOTS] * SLOTS, list(range(SLOTS))


_INPUTS: dict[tuple, tuple] = {}


def inputs(proj: str, tokens: int) -> tuple:
    """x, y, weights, batch, token slots of one case (one projection's buffers kept)."""
    key = (proj, tokens)
    if key not in _INPUTS:
        if not any(k[0] == proj for k in _INPUTS):
            _INPUTS.clear()
        n_in, slices = PROJECTIONS[proj]
        g = torch.Generator(device=DEVICE).manual_seed(0)
        out = sum(slices)
        a = torch.randn(SLOTS, len(slices) * RANK, n_in, device=DEVICE, dtype=DTYPE,
                        generator=g) * n_in ** -0.5
        b = torch.randn(SLOTS, out, RANK, device=DEVICE, dtype=DTYPE, generator=g) * 0.1
        weights = LoRAWeights(a, b, torch.full((SLOTS,), 2.0, device=DEVICE), slices, RANK)
        x = torch.randn(tokens, n_in, device=DEVICE, dtype=DTYPE, generator=g)
        y = torch.randn(tokens, out, device=DEVICE, dtype=DTYPE, generator=g)
        lens, slots = segments(tokens)
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)
        batch = LoRABatch(lens, slots, [RANK] * SLOTS,
                          torch.tensor(indptr, dtype=torch.int32, device=DEVICE),
                          torch.tensor(slots, dtype=torch.int32, device=DEVICE))
        token_slots = torch.repeat_interleave(batch.seg_slots_t.long(),
                                              torch.tensor(lens, device=DEVICE))
        _INPUTS[key] = (x, y, weights, batch, token_slots)
    return _INPUTS[key]


def min_bytes(proj: str, tokens: int) -> int:
    """What the delta must move: x once, A and B of each adapter used, y read and written."""
    n_in, slices = PROJECTIONS[proj]
    used = len(set(segments(tokens)[1]))
    elems = tokens * n_in + used * (len(slices) * RANK * n_in + sum(slices) * RANK) \
        + 2 * tokens * sum(slices)
    return elems * torch.finfo(DTYPE).bits // 8


def impl_fn(name: str, case: tuple):
    x, y, weights, batch, token_slots = case
    if name == PEER:
        return lambda: per_adapter_loop(x, y, weights, token_slots)
    reg = get_registry().get("lora", name)
    target = "cuda" if CUDA else "cpu"
    reasons = check_device(reg.caps, get_registry().probe(target))
    if reasons:
        pytest.skip(f"{name} cannot run on this {target}: {'; '.join(reasons)}")
    backend = reg.load()(LoRAConfig(SLOTS, RANK, DTYPE, DEVICE))
    if reg.caps.graph_safe and x.shape[0] in DECODE:  # what a decode graph replays
        batch = LoRABatch.on_device(batch.seg_indptr, batch.seg_slots_t)
    meta = backend.prepare(batch)
    return lambda: backend.apply(x, y, weights, batch, meta)


class WallClock:
    """pytest-benchmark's timer on a CPU, with the samples kept (as EventClock does)."""

    __name__ = "perf_counter"

    def __init__(self):
        self.total, self.samples = 0.0, []

    def __call__(self) -> float:
        return self.total

    def run(self, fn) -> None:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        self.total += dt
        self.samples.append(dt)

    def median(self, last: int) -> float:
        s = sorted(self.samples[-last:])
        return s[len(s) // 2]


@pytest.fixture(scope="session")
def copy_bps() -> float:
    """Copy bandwidth (bytes read + written per second) of this device, measured now."""
    if CUDA:
        from ceilings import copy_bandwidth

        return copy_bandwidth(DEVICE)
    src = torch.empty(2**26)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(8):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


@pytest.fixture(scope="session", autouse=True)
def threads():
    if not CUDA:
        before = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("CORE_BENCH_THREADS", "1")))
        yield torch.get_num_threads()
        torch.set_num_threads(before)
    else:
        yield None


@pytest.fixture
def lora_clock(benchmark):
    c = EventClock(DEVICE) if CUDA else WallClock()
    if hasattr(benchmark, "_timer"):
        benchmark._timer = c
    return c


@pytest.fixture(scope="session")
def results(request):
    rows: list[dict] = []
    yield rows
    if rows:
        _report(request.config, rows)


@pytest.mark.parametrize(("proj", "tokens", "impl"),
                         [(p, t, i) for p in PROJECTIONS for t in DECODE + PREFILL
                          for i in IMPLS])
def test_lora_delta(benchmark, lora_clock, copy_bps, threads, results, proj, tokens, impl):
    case = inputs(proj, tokens)
    x, y, weights, batch, _ = case
    fn = impl_fn(impl, case)
    y0 = y.clone()
    fn()  # compiles, and gives the result to check
    got = y.clone()
    y.copy_(y0)
    ref = per_adapter_loop(x, y, weights, case[4]).clone() if impl != PEER else None
    if ref is not None:
        err = (got.float() - ref.float()).abs().max().item()
        scale = (ref.float() - y0.float()).abs().max().item()
        # an implementation that computes something else is not benchmarked
        assert err <= (2e-2 if DTYPE != torch.float32 else 1e-4) * max(scale, 1.0), (impl, err)
    y.copy_(y0)
    lora_clock.run(fn)
    rounds = max(5, min(50, math.ceil(0.5 / max(lora_clock.samples[-1], 1e-6))))
    benchmark.group = f"lora {proj} T={tokens}"
    benchmark.pedantic(lora_clock.run, args=(fn,), rounds=rounds, warmup_rounds=1,
                       iterations=1)
    y.copy_(y0)  # the timed calls added the delta again and again
    seconds = lora_clock.median(rounds)
    nbytes = min_bytes(proj, tokens)
    info = dict(impl=impl, proj=proj, tokens=tokens, median_ms=seconds * 1e3,
                achieved_GBps=nbytes / seconds / 1e9, ratio_to_copy=nbytes / seconds / copy_bps,
                copy_GBps=copy_bps / 1e9, device=torch.cuda.get_device_name(DEVICE) if CUDA
                else "cpu", dtype=str(DTYPE).removeprefix("torch."), threads=threads)
    benchmark.extra_info.update(info)
    results.append(info)


def _report(config, rows: list[dict]) -> None:
    c = rows[0]
    loop = {(r["proj"], r["tokens"]): r["median_ms"] for r in rows if r["impl"] == PEER}
    lines = [f"LoRA delta on {c['device']} ({c['dtype']}"
             + (f", {c['threads']} thread(s)" if c["threads"] else "")
             + f"): copy {c['copy_GBps']:.1f} GB/s (measured this run); {SLOTS} adapters of "
             f"rank {RANK}", "",
             "| projection | tokens | impl | median ms | GB/s moved (of copy) "
             "| x per-adapter loop |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = loop.get((r["proj"], r["tokens"]))
        speed = f"{base / r['median_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['proj']} | {r['tokens']} | {r['impl']} | {r['median_ms']:.3f} | "
                     f"{r['achieved_GBps']:.1f} ({r['ratio_to_copy']:.2f}) | {speed} |")
    emit_table(config, "\n".join(lines))
