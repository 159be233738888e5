"""Benchmarks are collected from bench_*.py (run `pytest bench/`); they are never run as tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Shared helpers (the HF reference model) live with the tests.
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself; a folder needs this.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


# -- GPU benchmark fixtures (bench_attention.py, bench_moe.py) ------------------------------------

@pytest.fixture(scope="session")
def gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: these benchmarks run on a GPU")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def ceilings(gpu):
    """Copy bandwidth and the bf16 matmul rate, measured once per session (ceilings.py)."""
    from ceilings import measure

    return measure(gpu, torch.bfloat16)


@pytest.fixture
def clock(benchmark, gpu):
    """An EventClock that is also pytest-benchmark's timer, so its statistics are GPU times."""
    from ceilings import EventClock

    c = EventClock(gpu)
    # pytest-benchmark takes its timer from the command line only; its fixture keeps it in
    # `_timer`. Swapping in the event clock makes the recorded statistics GPU times.
    if hasattr(benchmark, "_timer"):
        benchmark._timer = c
        benchmark.extra_info["timer"] = "cuda_events"
    else:
        benchmark.extra_info["timer"] = "host wall clock (GPU times in extra_info only)"
    return c
