"""bench/bench_lora.py's per-adapter torch loop computes the protocol's sum (the conformance
suite's fp32 reference) on its cases, so timings against it compare like with like; and its
bytes-moved count is what its docstring says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_lora import min_bytes, per_adapter_loop, segments  # noqa: E402

from conformance.lora_suite import CASES, make_inputs, reference_lora  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_per_adapter_loop_matches_the_reference(case):
    x, y, w, batch = make_inputs(case, torch.float32, torch.device("cpu"), 7)
    want = reference_lora(x, y, w, batch.seg_lens, batch.seg_slots)
    token_slots = torch.repeat_interleave(batch.seg_slots_t.long(),
                                          torch.tensor(batch.seg_lens, dtype=torch.long))
    got = per_adapter_loop(x, y.clone(), w, token_slots)
    # fp32 sums in another order: about the rounding of the largest values (600-wide inputs)
    scale = want.abs().amax().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=max(1e-5, 2e-6 * scale))


def test_cases_and_bytes():
    assert segments(8) == ([1] * 8, list(range(8)))  # decode: neighbours on different adapters
    assert segments(1) == ([1], [0])
    assert segments(2048) == ([256] * 8, list(range(8)))
    # qkv at one token (fp32 on a CPU, bf16 on a GPU): x, one adapter's A (3 x 16 x 4096) and
    # B (6144 x 16), y read and written
    elems = 4096 + 3 * 16 * 4096 + 6144 * 16 + 2 * 6144
    assert min_bytes("qkv", 1) in (4 * elems, 2 * elems)
