"""The LoRA-backend conformance suite (conformance/lora_suite.py) over every registered backend
(torch_native; triton under TRITON_INTERPRET=1 on a CPU, fp32 and fp16 at small shapes: the
interpreter computes bf16 dots wrongly, so bf16 is a GPU check, `pytest -m gpu` on a GPU
machine), shown to fail backends that are wrong, and run the way a third-party package runs it:
`pytest --conformance-lora NAME`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

# Before any Triton kernel module is imported (the triton backend's factory imports them lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance import lora_suite as suite  # noqa: E402
from conformance.lora_suite import *  # noqa: E402,F401,F403 - the suite, over every backend
from conformance.lora_suite import (  # noqa: E402
    CASES,
    GRAPH_CASES,
    TP_CASES,
    TP_SIZES,
    check_case,
    check_graph_step,
    check_tp_case,
    make_inputs,
    reference_lora,
)
from core.contract.capabilities import LoRACaps  # noqa: E402
from core.plan.registry import get_registry  # noqa: E402
from plugins.lora.torch_native.backend import TorchNativeLoRA  # noqa: E402

INTERPRETED = (os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
               and importlib.util.find_spec("triton") is not None)


def test_torch_native_is_registered_and_every_case_is_collected():
    backends = get_registry().kind("lora")
    assert "torch_native" in backends
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)
    ids = {p.id for p in suite.lora_params(unnamed)}
    assert {f"torch_native-cpu-{c.id}-float32" for c in CASES} <= ids
    ranks = {r for c in CASES for r in c.ranks}
    assert {8, 16, 32, 64} <= ranks  # the ranks the issue names are covered
    if INTERPRETED:  # triton on the CPU: fp32 and fp16, every case
        assert {f"triton-cpu-{c.id}-{d}" for c in CASES for d in ("float32", "float16")} <= ids
        assert not any(i.startswith("triton-cpu") and i.endswith("bfloat16") for i in ids)
    # both ways a backend may serve a step: decode-sized and prefill-sized
    sizes = {sum(n for n, _ in c.segments) for c in CASES}
    assert min(sizes) == 0 and max(sizes) > 64


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


def test_tp_cases_are_collected_and_a_backend_without_tp_is_skipped(monkeypatch):
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)
    ids = {p.id for p in suite.lora_tp_params(unnamed)}
    assert {f"torch_native-cpu-{tc.id}-tp{n}-{d}" for tc in TP_CASES for n in TP_SIZES
            for d in ("float32", "bfloat16")} <= ids
    # both splits, GQA's KV heads split (tp 2) and replicated (tp 4), a prefill-sized step
    assert {tc.parallel for tc in TP_CASES} == {"column", "row"} and TP_SIZES == (2, 4)
    assert any(tc.head_dim and tc.case.slices[1] // tc.head_dim < 4 for tc in TP_CASES)
    assert max(sum(n for n, _ in tc.case.segments) for tc in TP_CASES) > 64
    if INTERPRETED:  # triton on the CPU: fp32 only unless --conformance-full
        assert {f"triton-cpu-{tc.id}-tp{n}-float32" for tc in TP_CASES for n in TP_SIZES} <= ids
        assert not any(i.startswith("triton-cpu") and "-tp" in i and not i.endswith("float32")
                       for i in ids)
    real = get_registry()
    no_tp = types.SimpleNamespace(caps=LoRACaps(devices=("cpu",), tensor_parallel=False))
    registry = types.SimpleNamespace(
        kind=lambda kind: {"no_tp": no_tp} if kind == "lora" else real.kind(kind),
        probe=real.probe)
    monkeypatch.setattr("core.plan.registry.get_registry", lambda: registry)
    params = suite.lora_tp_params(unnamed)
    assert [p.id for p in params] == ["no_tp-cpu-tp"]
    assert "declares tensor_parallel=False" in params[0].marks[-1].kwargs["reason"]


def test_a_third_party_runs_it_by_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-lora", "torch_native", "--conformance-device", "cpu",
                           "--conformance-seed", "3", "--rootdir", str(tmp_path),
                           str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # float32 and bfloat16, unsplit and at each simulated tp size
    assert f"{2 * (len(CASES) + len(TP_CASES) * len(TP_SIZES))} passed" in proc.stdout, \
        proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-lora", "nope", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "nope not registered" in proc.stdout + proc.stderr


class _DropsInputTail(TorchNativeLoRA):
    """Reads the inputs in blocks of 8 and drops the rest (a kernel's unmasked K tail): right
    on every unsplit case (their inputs are multiples of 8), wrong on a row-parallel rank's
    36 or 18 inputs."""

    def apply(self, x, y, weights, batch, meta):
        k = x.shape[1] // 8 * 8
        w = type(weights)(weights.a[..., :k], weights.b, weights.scalings,
                          weights.output_slices, weights.max_rank)
        return super().apply(x[:, :k], y, w, batch, meta)


class _DropsRowTail(TorchNativeLoRA):
    """Adds the delta to each output slice's rows in blocks of 8 only (a kernel's unmasked N
    tail): right on every unsplit case, wrong on a column-parallel rank's 18-row slices."""

    def apply(self, x, y, weights, batch, meta):
        before, off = y.clone(), 0
        super().apply(x, y, weights, batch, meta)
        for width in weights.output_slices:
            y[:, off + width // 8 * 8:off + width] = before[:, off + width // 8 * 8:off + width]
            off += width
        return y


@pytest.mark.parametrize("bad,tp_case", [(_DropsInputTail, "down-decode-row"),
                                         (_DropsRowTail, "gate-up-column")])
def test_backends_wrong_only_on_rank_shapes_fail_the_tp_case(bad, tp_case):
    cpu = torch.device("cpu")
    for case in CASES:  # the unsplit suite does not see it
        check_case(bad, case, torch.float32, cpu, 0)
    tc = next(tc for tc in TP_CASES if tc.id == tp_case)
    check_tp_case(TorchNativeLoRA, tc, 1, torch.float32, cpu, 0)  # one rank: the whole
    check_case(bad, tc.case, torch.float32, cpu, 0)
    for size in TP_SIZES:
        with pytest.raises(AssertionError, match=f"at tp {size}"):
            check_tp_case(bad, tc, size, torch.float32, cpu, 0)


class _Poisoned:
    """A LoRABatch whose host lists cannot be read: only its device tensors and token count."""

    def __init__(self, batch):
        self.seg_indptr, self.seg_slots_t = batch.seg_indptr, batch.seg_slots_t
        self.num_tokens, self.device_only = batch.num_tokens, batch.device_only

    def __getattr__(self, name):
        raise AssertionError(f"read the host list {name} of a decode step")


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                    reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_triton_decode_steps_read_only_device_tensors():
    """LoRACaps.graph_safe of the triton backend: a decode-sized step is prepared and applied
    from seg_indptr / seg_slots_t and the token count alone (no host list, no sync), the same
    sums as the reference; a prefill-sized one may use the host lists."""
    from core.contract.lora import LoRAConfig
    from plugins.lora.triton import CAPS
    from plugins.lora.triton.backend import DECODE_TOKENS, TritonLoRA

    assert CAPS.graph_safe
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for case in (c for c in CASES if c.id in ("decode-like", "decode-grouped")):
        assert sum(n for n, _ in case.segments) <= DECODE_TOKENS
        backend = TritonLoRA(LoRAConfig(len(case.ranks), case.max_rank, torch.float32, device))
        x, y, weights, batch = make_inputs(case, torch.float32, device, 5)
        want = reference_lora(x, y, weights, batch.seg_lens, batch.seg_slots)
        poisoned = _Poisoned(batch)
        got = backend.apply(x, y, weights, poisoned, backend.prepare(poisoned))
        torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)
    long = next(c for c in CASES if c.id == "prefill-long")
    x, y, weights, batch = make_inputs(long, torch.float32, device, 5)
    with pytest.raises(AssertionError, match="read the host list"):
        backend.prepare(_Poisoned(batch))


# -- device-only steps (decode graphs) -------------------------------------------------------------


def test_graph_cases_are_collected_and_a_backend_not_graph_safe_is_skipped():
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)
    params = suite.lora_graph_params(unnamed)
    native = [p for p in params if p.id.startswith("torch_native-cpu")]
    assert [p.id for p in native] == ["torch_native-cpu-graph"]
    assert "declares graph_safe=False" in native[0].marks[-1].kwargs["reason"]
    # one small bucket, one over the 64 tokens a backend may serve token by token eagerly
    assert all(n == 1 for c in GRAPH_CASES for n, _ in c.segments)
    assert min(len(c.segments) for c in GRAPH_CASES) < 64 < max(len(c.segments)
                                                                for c in GRAPH_CASES)
    if INTERPRETED:
        assert {f"triton-cpu-{c.id}-float32" for c in GRAPH_CASES} <= {p.id for p in params}


class _Eager(TorchNativeLoRA):
    """torch_native over a device-only step's slots read back to the host (a sync: right
    numbers, but it could not be captured)."""

    def slots(self, batch):
        return batch.seg_slots_t.tolist()

    def prepare(self, batch):
        from core.contract.lora import LoRABatch

        slots = self.slots(batch)
        return super().prepare(LoRABatch([1] * len(slots), slots,
                                         [self.config.max_rank] * self.config.num_slots,
                                         batch.seg_indptr, batch.seg_slots_t))


class _BakesSlots(_Eager):
    """Reads the slot row once and keeps it (as a capture would bake host values in)."""

    kept = None

    def slots(self, batch):
        if self.kept is None:
            self.kept = batch.seg_slots_t.tolist()
        return self.kept


class _ReadsHostSlots(TorchNativeLoRA):
    """Serves a device-only step from its host lists."""


@pytest.mark.parametrize("bad,match", [(_BakesSlots, "after a slot reload"),
                                       (_ReadsHostSlots, "not on the host")])
def test_backends_wrong_on_device_only_steps_fail_the_graph_case(bad, match):
    cpu = torch.device("cpu")
    for case in GRAPH_CASES:  # the arithmetic the check expects, from the device tensors
        check_graph_step(_Eager, case, torch.float32, cpu, 0)
    with pytest.raises((AssertionError, RuntimeError), match=match):
        check_graph_step(bad, GRAPH_CASES[0], torch.float32, cpu, 0)
