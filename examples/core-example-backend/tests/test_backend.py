"""This package's own tests, beside core-serve's conformance suite.

The suite (added to every `pytest` run here by pyproject.toml's `--conformance-backend
example_sdpa`) checks what example_sdpa declares: output, KV write and untouched pool against the
fp32 reference and torch_native, on page size 16, fp32/fp16/bf16, head dims 64/128, MHA/GQA/MQA,
prefill and decode. It lists what the backend does not declare as skipped (`pytest -rs`). What
it cannot know is how a backend refuses what it does not support; that is tested here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from core_example_backend import ATTENTION_CAPS

from conformance.paged_batch import AttentionCase, build_inputs
from core.contract.attention import BackendContext
from core.plan.registry import get_registry


def test_registered_from_this_distribution():
    reg = get_registry().get("attention", "example_sdpa")
    assert reg.origin.dist == "core-example-backend"
    assert reg.caps == ATTENTION_CAPS


def _context(head_dim: int) -> BackendContext:
    return BackendContext(num_heads=2, num_kv_heads=2, head_dim=head_dim, num_layers=1,
                          dtype=torch.float32, kv_dtype=torch.float32,
                          device=torch.device("cpu"), page_size=16, max_context_len=32)


def test_undeclared_head_size_is_refused():
    backend = get_registry().get("attention", "example_sdpa").load()
    with pytest.raises(ValueError, match="head sizes 64 and 128"):
        backend(_context(96))


@pytest.mark.parametrize("feature", [{"sliding_window": 4}, {"logit_softcap": 5.0}])
def test_undeclared_features_are_refused_not_ignored(feature):
    case = AttentionCase("decode", 2, 1, 64, 16, "float32", "float32", (5, 20), (1, 1))
    inputs = build_inputs(case, "cpu", seed=0)
    backend = get_registry().get("attention", "example_sdpa").load()(inputs.ctx)
    layer = dataclasses.replace(inputs.layers[0], **feature)
    q, k, v = inputs.qkv[0]
    with pytest.raises(ValueError, match="does not support"):
        backend.forward(q, k, v, layer, inputs.batch)
