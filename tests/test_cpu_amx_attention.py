"""cpu_amx (issue 38): causal extend attention on AMX bf16 tiles (plugins/attention/cpu_c/amx.py).

The kernel (attn_amx.c) is checked against an fp32 softmax attention of the same bf16 inputs
in two builds: on emulated tiles (-DAMX_EMULATE: the same layouts, masks and softmax with
plain-C tile primitives, so it runs on any CPU) and on real tiles (skipped, saying why, on a CPU
without AMX). The backend, on emulated tiles, runs the attention conformance suite's cases
(pool writes, poisoned slots, fp32 reference, torch_native) and its dispatch is checked:
long bf16 extends on the tiles, decode / short / fp32 extends on the inherited paths.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from test_gguf_quant import cpu_features

from conformance.attention_cases import conformance_cases
from conformance.attention_check import check_case, run_backend
from conformance.paged_batch import AttentionCase, build_inputs
from core.plan.registry import Origin, Registration
from plugins._kit.cbuild import ISA_FEATURES, build
from plugins._kit.torch_attention import TorchNativeAttention
from plugins.attention import cpu_c
from plugins.attention.cpu_c.amx import (
    SOURCE,
    CpuAmxEmulated,
    extend_attention,
    library,
)

AMX = ISA_FEATURES["amx"]
needs_amx = pytest.mark.skipif(not AMX <= cpu_features(),
                               reason=f"this CPU lacks {sorted(AMX - cpu_features())}")
BUILDS = [pytest.param("emulated", id="emulated"),
          pytest.param("amx", id="amx", marks=needs_amx)]

# mixed prefixes (none, under one block, several blocks) and extends (one token, not multiples
# of the 16-row query blocks or the 32-key blocks)
PREFIX, NEW = (0, 5, 37, 100), (1, 17, 33, 200)


def pool_batch(prefix, new, hkv: int, d: int, seed: int):
    """A bf16 pool whose requests' slots are scattered over it (a shuffled slot table), the
    slots no request owns NaN (a read of one shows), and the step's queries."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    slots_n = sum(lens) + 64
    k_buf = torch.full((slots_n, hkv, d), float("nan")).bfloat16()
    v_buf = k_buf.clone()
    perm = torch.randperm(slots_n, generator=gen)
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    o = 0
    for b, n in enumerate(lens):
        slots[b, :n] = perm[o:o + n]
        o += n
        k_buf[slots[b, :n]] = torch.randn(n, hkv, d, generator=gen).bfloat16()
        v_buf[slots[b, :n]] = torch.randn(n, hkv, d, generator=gen).bfloat16()
    return k_buf, v_buf, slots, gen


# Error sources: the output's bf16 rounding (up to 2^-8 of |out|) and P rounded to bf16
# (relative 2^-8 per weight at most, of random sign, so the output moves by a few 2^-8 |v|
# / sqrt(visible keys), |v| ~ N(0, 1)); measured at most 3.3e-3 past the first term over the
# mixed-batch cases. A wrong mask, scale or layout errs by 0.1 or more.
EXCESS_TOL = 6e-3  # the largest error past the output's own rounding
MEAN_TOL = 1.5e-3  # the mean error


def errors(got, want):
    """(largest |got - want| past 2^-8 |want|, mean |got - want|), as floats."""
    err = (got.float() - want).abs()
    return (err - want.abs() * 2**-8).max().item(), err.mean().item()


def reference(q, k_buf, v_buf, slots, prefix, new, scale, window=None, cap=None):
    """fp32 softmax attention of the same bf16 values: token j of request b at position
    prefix + j sees keys 0 .. prefix + j (the last `window` of them)."""
    H, hkv = q.shape[1], k_buf.shape[1]
    outs, t = [], 0
    for b, (p, n) in enumerate(zip(prefix, new, strict=True)):
        L = p + n
        k = k_buf[slots[b, :L]].float().repeat_interleave(H // hkv, 1)  # [L, H, D]
        v = v_buf[slots[b, :L]].float().repeat_interleave(H // hkv, 1)
        s = torch.einsum("nhd,lhd->hnl", q[t:t + n].float(), k) * scale
        t += n
        if cap:
            s = cap * torch.tanh(s / cap)
        pos, j = torch.arange(p, L).unsqueeze(1), torch.arange(L).unsqueeze(0)
        visible = j <= pos
        if window:
            visible &= j > pos - window
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", s.softmax(-1), v).reshape(n, -1))
    return torch.cat(outs)


@pytest.mark.parametrize("kind", BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (24, None), (None, 5.0), (7, 3.0)])
def test_extend_matches_fp32_reference(kind, heads, kv_heads, head_dim, window, cap):
    if head_dim == 128 and (window, cap) != (None, None) and kind == "emulated":
        pytest.skip("covered at head dim 64 (keeps the emulated tiles' runs short)")
    lib = library(kind)
    k_buf, v_buf, slots, gen = pool_batch(PREFIX, NEW, kv_heads, head_dim, seed=head_dim + heads)
    T = sum(NEW)
    q = torch.randn(T, heads, head_dim, generator=gen).bfloat16()
    starts = [sum(NEW[:b]) for b in range(len(NEW))]
    lens = torch.tensor([PREFIX, NEW, starts], dtype=torch.int64)
    scale = 1 / math.sqrt(head_dim)
    got = extend_attention(lib, q, k_buf, v_buf, slots, lens, scale, window, cap, threads=2)
    want = reference(q, k_buf, v_buf, slots, PREFIX, NEW, scale, window, cap)
    assert got.shape == (T, heads * head_dim) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all(), "a NaN slot outside the requests was read"
    excess, mean = errors(got, want)
    assert excess < EXCESS_TOL, f"error {excess} past the output's rounding"
    assert mean < MEAN_TOL


@pytest.mark.parametrize("kind", BUILDS)
def test_a_tokens_output_does_not_depend_on_its_batch(kind):
    """Request 2 alone gives the bits it gives among the others (fixed work items, fixed order);
    and the same bits with one thread."""
    lib = library(kind)
    k_buf, v_buf, slots, gen = pool_batch(PREFIX, NEW, 3, 64, seed=5)
    q = torch.randn(sum(NEW), 9, 64, generator=gen).bfloat16()
    starts = [sum(NEW[:b]) for b in range(len(NEW))]
    both = extend_attention(lib, q, k_buf, v_buf, slots,
                            torch.tensor([PREFIX, NEW, starts]), 0.125, threads=2)
    s2 = starts[2]
    alone = extend_attention(lib, q[s2:s2 + NEW[2]], k_buf, v_buf, slots[2:3].contiguous(),
                             torch.tensor([[PREFIX[2]], [NEW[2]], [0]]), 0.125, threads=1)
    assert torch.equal(both[s2:s2 + NEW[2]], alone)


def test_refuses_what_it_cannot_take():
    lib = library("emulated")
    k_buf, v_buf, slots, _ = pool_batch((0,), (20,), 2, 48, seed=1)
    lens = torch.tensor([[0], [20], [0]])
    with pytest.raises(ValueError, match="multiple of 32"):
        extend_attention(lib, torch.zeros(20, 4, 48).bfloat16(), k_buf, v_buf, slots, lens, 1.0)
    k_buf, v_buf, slots, _ = pool_batch((0,), (20,), 2, 64, seed=1)
    with pytest.raises(ValueError, match="bf16"):
        extend_attention(lib, torch.zeros(20, 4, 64), k_buf, v_buf, slots, lens, 1.0)


def test_the_real_tile_build_compiles():
    """The `amx` variant compiles with the tile intrinsics (not the emulation) on any machine
    whose compiler knows -mamx-tile; loading it runs no tile instruction."""
    lib = build(SOURCE, "amx")
    lib.amx_attn_variant.restype = ctypes.c_char_p
    assert lib.amx_attn_variant() == b"amx"
    assert library("emulated").amx_attn_variant() == b"emulated"


# --------------------------------------------------------------------------- the backend

def _caps():
    got = {}
    cpu_c.core_register_attention_backends(register=lambda n, c, f: got.update({n: c}))
    return got["cpu_amx"]


def emulated_registration() -> Registration:
    """cpu_amx's declaration with the emulated-tile class as its factory."""
    return Registration("attention", "cpu_amx", _caps(), CpuAmxEmulated,
                        Origin("cpu_c", "<in-process>"))


def test_declaration():
    caps = _caps()
    # opt-in until measured on an AMX CPU: below cpu_c_avx512, above cpu_c_avx2
    assert caps.cpu_isa == AMX and 35 < caps.priority["cpu"] < 40
    assert caps.dtypes == {"float32", "bfloat16"} and not caps.sinks


TORCH_NATIVE = Registration("attention", "torch_native", _caps(),
                            "plugins.attention.torch_native.backend:TorchNativeAttention",
                            Origin("torch_native", "<in-process>"))


def _cases():
    """The suite's bf16 cases and one fp32 extend (fp32 runs torch_native's code)."""
    cases = conformance_cases(_caps(), False, ())
    fp32 = [c for c in cases if c.dtype == "float32" and c.mode == "extend"][:1]
    return [c for c in cases if c.dtype == "bfloat16"] + fp32


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_emulated_backend_passes_the_conformance_cases(case):
    """The suite's checks (output, KV write, untouched pool, fp32 reference, torch_native) on
    the backend with emulated tiles; its bf16 extends (40 new tokens) run on the tiles."""
    check_case(emulated_registration(), case, torch.device("cpu"), 0, TORCH_NATIVE)


@pytest.mark.parametrize(("dtype", "new", "tiles"), [
    ("bfloat16", (40, 3, 17), True),  # a request adds more than SHORT_EXTEND: the tiles
    ("bfloat16", (5, 3, 8), False),  # a verify-shaped extend: cpu_c's decode rows
    ("float32", (40, 3, 17), False),  # fp32: torch_native's extend
])
def test_dispatch(dtype, new, tiles):
    prefix = (0, 21, 64)
    case = AttentionCase("extend", 2, 4, 64, 16, dtype, dtype,
                         tuple(p + n for p, n in zip(prefix, new, strict=True)), new)
    inputs = build_inputs(case, "cpu", seed=7)
    meta = CpuAmxEmulated(inputs.ctx).prepare(inputs.batch)
    assert (meta.lens_t is not None) == tiles
    assert (meta.rows is not None) == (not tiles and dtype == "bfloat16")


def test_unaligned_head_dim_takes_torch_natives_extend():
    """Head dim 80 (not a multiple of 32): the extend runs torch_native's path, bit for bit."""
    case = AttentionCase("extend", 2, 2, 80, 16, "bfloat16", "bfloat16", (40, 60), (40, 20))
    a, b = build_inputs(case, "cpu", seed=2), build_inputs(case, "cpu", seed=2)
    got = run_backend(CpuAmxEmulated(a.ctx), a)[0]
    want = run_backend(TorchNativeAttention(b.ctx), b)[0]
    assert torch.equal(got, want)
