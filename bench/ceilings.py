"""Device ceilings measured in the same run as the kernels, and GPU timing for pytest-benchmark.

- copy bandwidth: a device-to-device copy of 1 GiB, counted as bytes read + bytes written;
- matmul rate: an 8192^3 GEMM in the given dtype (bf16 by default), 2*n^3 FLOP.

Timing follows triton.testing.do_bench: every timed call is preceded by a 512 MiB write that
evicts L2, and is measured with CUDA events. Between the flush and the start event the GPU also
spins for ~1 ms (torch.cuda._sleep), so the host has queued the whole call before the GPU
reaches it: what is timed is GPU execution, not host launch gaps inside a multi-kernel call
(on a slow host a backend's Python between its kernels otherwise shows up as idle GPU time).
CORE_BENCH_HOST_SLACK=0 leaves the spin out (launch gaps then count, as before 2026-11-30).
`EventClock` turns those event times into a pytest-benchmark timer, so the statistics
pytest-benchmark records (and writes to --benchmark-json) are GPU times, not host wall time.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

# > L2 of every current GPU (H100/H200: 50 MiB, MI300X: 256 MiB).
_FLUSH_BYTES = 512 * 2**20
# GPU cycles of spinning queued before each timed call: ~1 ms at H200 clocks (1.98 GHz), longer
# than the host needs to queue any call benchmarked here.
_HOST_SLACK_CYCLES = 2_000_000


class EventClock:
    """Accumulated GPU seconds of the calls made through `run`; callable as a timer."""

    __name__ = "cuda_event_clock"  # how pytest-benchmark names its timer in reports

    def __init__(self, device: torch.device):
        self.device = device
        self.total = 0.0
        self.samples: list[float] = []
        self._flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=device)
        self._slack = (device.type == "cuda" and hasattr(torch.cuda, "_sleep")
                       and os.environ.get("CORE_BENCH_HOST_SLACK", "1") != "0")

    def __call__(self) -> float:
        return self.total

    def run(self, fn: Callable[[], object]) -> None:
        """Flush L2, time one call of `fn` with CUDA events, add it to the clock."""
        self._flush.zero_()
        if self._slack:
            torch.cuda._sleep(_HOST_SLACK_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        self.total += seconds
        self.samples.append(seconds)

    def median(self, last: int) -> float:
        return statistics.median(self.samples[-last:])


def gpu_seconds(fn: Callable[[], object], device: torch.device, reps: int = 10,
                warmup: int = 2) -> float:
    """Median GPU seconds of one call of `fn` (L2 flushed before each)."""
    clock = EventClock(device)
    for _ in range(warmup + reps):
        clock.run(fn)
    return clock.median(reps)


@dataclass(frozen=True)
class Ceilings:
    """What this device achieves with plain torch ops, measured now."""

    device_name: str
    copy_bytes_per_s: float
    matmul_flop_per_s: float
    matmul_dtype: str

    def as_info(self) -> dict:
        return {"device": self.device_name, "copy_GBps": round(self.copy_bytes_per_s / 1e9, 1),
                "matmul_TFLOPs": round(self.matmul_flop_per_s / 1e12, 1),
                "matmul_dtype": self.matmul_dtype}


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = gpu_seconds(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = gpu_seconds(lambda: torch.matmul(a, b), device)
    return 2 * n ** 3 / seconds


def measure(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    return Ceilings(torch.cuda.get_device_name(device), copy_bandwidth(device),
                    matmul_rate(device, dtype), str(dtype).removeprefix("torch."))


def emit_table(config, text: str) -> None:
    """A benchmark session's closing table: to pytest's terminal, and to the file
    $CORE_BENCH_TABLE names (if set)."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for line in text.splitlines():
            reporter.write_line(line)
    path = os.environ.get("CORE_BENCH_TABLE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
