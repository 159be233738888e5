"""cpu_c runs short extends (a speculative verify step: each request's last token and its drafts) as
decode rows through its C decode kernel (plugins/_kit/pool_attention.py), a request's rows one
work item (ca_decode_rows): every new token's output must then be bit for bit what a decode step
of that token gives, which is what keeps greedy answers identical with speculation on (the
verify step rounds as decode does), in bf16 and fp32, for the AVX-512 loops (head dim 64) and
the portable ones (32), across the kernel's 64-key chunks (prefix 130).
The attention conformance suite's `verify` cases check the values against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from conformance.attention_check import run_backend
from conformance.paged_batch import AttentionCase, build_inputs
from core.contract.attention import AttentionLayerParams
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.plan.registry import get_registry

PREFIX, NEW = (12, 0, 130, 7), (5, 3, 8, 1)


def _backend(ctx):
    reg = get_registry().get("attention", "cpu_c")
    return reg.load()(ctx)


def _decode_one(backend, inputs, layer: AttentionLayerParams, q, k, v, b: int, j: int):
    """Token j of request b as a decode step of its own: seq_len prefix + j + 1."""
    batch, start = inputs.batch, sum(NEW[:b])
    t = start + j
    one = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=batch.input_ids[t:t + 1],
        positions=batch.positions[t:t + 1],
        seq_lens=torch.tensor([PREFIX[b] + j + 1], dtype=torch.int32),
        prefix_lens=torch.tensor([PREFIX[b] + j], dtype=torch.int32),
        extend_lens=torch.ones(1, dtype=torch.int32),
        out_cache_loc=batch.out_cache_loc[t:t + 1],
        req_pool_indices=batch.req_pool_indices[b:b + 1], req_to_token=batch.req_to_token,
        kv_pool=batch.kv_pool, seq_lens_cpu=[PREFIX[b] + j + 1], prefix_lens_cpu=[PREFIX[b] + j],
        extend_lens_cpu=[1])
    one.attn_backend = backend
    one.attn_meta = backend.prepare(one)
    return backend.forward(q[t:t + 1], k[t:t + 1], v[t:t + 1], layer, one)


@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("features", [{}, {"sliding_window": 6, "logit_softcap": 5.0},
                                      {"sliding_window": 70}])
def test_verify_rows_equal_decode_steps_bit_for_bit(features, dtype, head_dim):
    case = AttentionCase("extend", 2, 4, head_dim, 16, dtype, dtype,
                         tuple(p + n for p, n in zip(PREFIX, NEW, strict=True)), NEW,
                         **features)
    inputs = build_inputs(case, "cpu", seed=3)
    backend = _backend(inputs.ctx)
    meta = backend.prepare(inputs.batch)
    assert meta.rows is not None, "a verify-shaped extend should run as decode rows"
    got = run_backend(backend, inputs)[0]  # [T, H * Dv]
    layer = inputs.layers[0]
    q, k, v = inputs.qkv[0]
    for b, n in enumerate(NEW):
        for j in range(n):
            want = _decode_one(backend, inputs, layer, q, k, v, b, j)
            row = got[sum(NEW[:b]) + j]
            assert torch.equal(row, want[0]), f"request {b} token {j}: verify != decode"


@pytest.mark.parametrize(("dtype", "prefix", "new"), [
    ("bfloat16", (0, 6), (20, 3)),  # a request adds 20 > SHORT_EXTEND tokens
    ("float32", (4,), (17,)),
])
def test_other_extends_keep_the_prefill_path(dtype, prefix, new):
    case = AttentionCase("extend", 2, 4, 64, 16, dtype, dtype,
                         tuple(p + n for p, n in zip(prefix, new, strict=True)), new)
    inputs = build_inputs(case, "cpu", seed=4)
    meta = _backend(inputs.ctx).prepare(inputs.batch)
    assert meta.rows is None  # gather + SDPA
