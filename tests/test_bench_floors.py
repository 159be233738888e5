"""bench/floors.py, the offline floor behind issue 13's offline target: its parts against
independent counts (bench/moe_decode.py's active bytes, an 8B run's measured wall)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from floors import distinct_experts, offline_floor  # noqa: E402
from moe_decode import active_bytes_per_token  # noqa: E402

CONFIGS = REPO / "tests" / "fixtures" / "configs"
H200 = {"matmul_flops": 790e12, "copy_bytes_s": 4.223e12}  # bench/RESULTS.md's ceilings


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_distinct_experts_goes_from_top_k_to_all():
    assert distinct_experts(128, 8, 1) == pytest.approx(8)
    assert distinct_experts(128, 8, 256) == pytest.approx(128, rel=1e-6)
    assert 8 < distinct_experts(128, 8, 16) < 128
    assert distinct_experts(0, 0, 64) == 0


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_one_request_decodes_its_active_weights_each_step(name):
    """With one request every decode step reads the active weights once (moe_decode.py's own
    count, written separately) plus the KV cache."""
    cfg = _cfg(name)
    f = offline_floor(cfg, 1, 1, 100, 1, **H200)
    assert f["decode_bytes"] == pytest.approx(100 * active_bytes_per_token(cfg), rel=0.01)


def test_the_8b_floor_lies_under_a_measured_run():
    """Llama-3.1-8B shapes, 1,000 x 1,024 in / 256 out: RESULTS' H200 run took 43.2 s; the
    floor must be under it, and its prefill part at least the weights' GEMM FLOPs."""
    f = offline_floor(_cfg("llama-3.1-8b"), 1000, 1024, 256, 256, **H200)
    weights_flops = 2 * 6.98e9 * 1000 * 1024  # non-embedding parameters
    assert f["prefill_flops"] >= weights_flops
    assert 20 < f["floor_s"] < 43.2
    assert f["waves"] == 4


def test_a_moe_prefill_counts_its_top_k_experts_not_all():
    cfg = _cfg("qwen3-30b-a3b")
    moe = offline_floor(cfg, 10, 512, 1, 10, **H200)
    dense = dict(cfg, num_experts_per_tok=cfg["num_experts"])
    every = offline_floor(dense, 10, 512, 1, 10, **H200)
    assert every["prefill_flops"] > 10 * moe["prefill_flops"]


def test_deepseek_v2_lite_counts():
    """DeepSeek-V2-Lite (MLA, 64 routed experts top-6, 2 shared, the first layer dense): both
    counts agree, its active weights are DeepSeek's published ~2.4B activated parameters (plus
    the embedding row and LM head here), and a token's KV is one 576-value latent row a layer."""
    from floors import kv_bytes_per_token

    cfg = _cfg("deepseek-v2-lite")
    active = active_bytes_per_token(cfg) / 2
    lm_head = cfg["vocab_size"] * cfg["hidden_size"]
    assert 2.1e9 < active - lm_head < 2.5e9
    f = offline_floor(cfg, 1, 1, 100, 1, **H200)
    assert f["decode_bytes"] == pytest.approx(100 * active_bytes_per_token(cfg), rel=0.01)
    assert kv_bytes_per_token(cfg, 2) == 27 * 576 * 2
