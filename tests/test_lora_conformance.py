"""The LoRA-backend conformance suite (conformance/lora_suite.py) over every registered backend
(torch_native built in), shown to fail backends that are wrong, and run the way a third-party
package runs it: `pytest --conformance-lora NAME`."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from conformance import lora_suite as suite
from conformance.lora_suite import *  # noqa: F401,F403 - the suite, over every backend
from conformance.lora_suite import CASES, check_case
from core.plan.registry import get_registry
from plugins.lora.torch_native.backend import TorchNativeLoRA


def test_torch_native_is_registered_and_every_case_is_collected():
    backends = get_registry().kind("lora")
    assert "torch_native" in backends
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)
    ids = {p.id for p in suite.lora_params(unnamed)}
    assert {f"torch_native-cpu-{c.id}-float32" for c in CASES} <= ids
    ranks = {r for c in CASES for r in c.ranks}
    assert {8, 16, 32, 64} <= ranks  # the ranks the issue names are covered


class _NoScale(TorchNativeLoRA):
    """Forgets the scalings."""

    def apply(self, x, y, weights, batch, meta):
        w = type(weights)(weights.a, weights.b, torch.ones_like(weights.scalings),
                          weights.output_slices, weights.max_rank)
        return super().apply(x, y, w, batch, meta)


class _OneSlice(TorchNativeLoRA):
    """Treats a fused output as one slice (uses only A's first block)."""

    def apply(self, x, y, weights, batch, meta):
        w = type(weights)(weights.a, weights.b, weights.scalings, (sum(weights.output_slices),),
                          weights.max_rank)
        return super().apply(x, y, w, batch, meta)


class _TouchesBase(TorchNativeLoRA):
    """Adds slot 0's delta to base-only tokens too."""

    def prepare(self, batch):
        b = type(batch)(batch.seg_lens, [0 if s == -1 else s for s in batch.seg_slots],
                        batch.ranks, batch.seg_indptr, batch.seg_slots_t)
        return super().prepare(b)


class _FirstSegmentOnly(TorchNativeLoRA):
    """Serves only the first segment of each slot."""

    def prepare(self, batch):
        seen, slots = set(), []
        for s in batch.seg_slots:
            slots.append(s if s not in seen else -1)
            seen.add(s)
        b = type(batch)(batch.seg_lens, slots, batch.ranks, batch.seg_indptr,
                        batch.seg_slots_t)
        return super().prepare(b)


@pytest.mark.parametrize("bad,case", [(_NoScale, "gate-up"), (_OneSlice, "mixed-qkv"),
                                      (_TouchesBase, "base-only"),
                                      (_FirstSegmentOnly, "mixed-qkv")])
def test_wrong_backends_fail_the_suite(bad, case):
    c = next(c for c in CASES if c.id == case)
    with pytest.raises(AssertionError):
        check_case(bad, c, torch.float32, torch.device("cpu"), 0)


def test_a_third_party_runs_it_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-lora", "torch_native", "--conformance-device", "cpu",
                           "--conformance-seed", "3", "--rootdir", str(tmp_path),
                           str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{2 * len(CASES)} passed" in proc.stdout, proc.stdout  # float32 and bfloat16
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-lora", "nope", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "nope not registered" in proc.stdout + proc.stderr
