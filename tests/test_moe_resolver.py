"""The MoE slot with the built-in runners: the plan for real MoE configs on simulated devices,
MoECaps fields as rejection reasons, and the triton runner's pieces (alignment, tilings, a tiny
model through it under the Triton interpreter)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the runner's kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from core.capabilities import MoECaps  # noqa: E402
from core.checks import check_moe  # noqa: E402
from core.config import ServerArgs  # noqa: E402
from core.devices import PROFILES  # noqa: E402
from core.model_spec import spec_from_config  # noqa: E402
from core.plugins import get_registry  # noqa: E402
from core.resolver import resolve  # noqa: E402

QWEN3_30B_A3B = {  # the public config.json of Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def registry():
    return get_registry()


def test_qwen3_moe_on_h200_plans_triton_with_graphs(registry):
    spec = spec_from_config(QWEN3_30B_A3B)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.renormalize) == (128, 8, True)
    plan = resolve(spec, PROFILES["h200"], ServerArgs(), registry)
    assert (plan.moe_runner, plan.model_impl) == ("triton", "qwen3_moe")
    if plan.decode_attention == "triton":  # graphs need every decode-step backend to allow them
        assert plan.cuda_graph


def test_qwen3_moe_on_a_cpu_plans_torch_native(registry):
    plan = resolve(spec_from_config(QWEN3_30B_A3B), PROFILES["x86-cpu"], ServerArgs(),
                   registry)
    assert plan.moe_runner == "torch_native"
    triton = next(c for c in plan.candidates if c.slot == "moe_runner" and c.name == "triton")
    assert "device cpu not supported (supports cuda, rocm)" in triton.reasons


def test_moe_caps_reasons():
    deepseek_v3_like = dict(QWEN3_30B_A3B, scoring_func="sigmoid", num_experts=256,
                            num_experts_per_tok=8, n_group=8, topk_group=4)
    spec = spec_from_config(deepseek_v3_like)
    assert spec.moe.scoring_func == "sigmoid" and spec.moe.grouped_topk
    caps = MoECaps(devices={"cuda"}, max_experts=128, max_top_k=4, quant_methods={"fp8"})
    assert check_moe(caps, spec, PROFILES["h200"], dtype="bfloat16",
                     quant_method="unquantized") == [
        "quant method unquantized not supported (supports fp8)",
        "sigmoid router scoring not supported (supports softmax)",
        "no grouped top-k routing (model Qwen3MoeForCausalLM routes within expert groups)",
        "256 experts exceed the limit of 128",
        "top-k 8 exceeds the limit of 4"]
    assert "scoring=softmax" in caps.summary() and "max_experts=128" in caps.summary()


# ---- the triton runner's pieces ----------------------------------------------------------

triton_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs a GPU or TRITON_INTERPRET=1")


@triton_only
def test_align_by_expert():
    from plugins.moe.triton.runner import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])  # rows 0..5; expert 2 gets none
    sorted_ids, block_expert, total = align_by_expert(ids, 4, 4)
    assert int(total) == 12  # experts 0, 1, 3: one block of 4 each
    n = ids.numel()
    assert sorted_ids[:4].tolist() == [1, 5, n, n]  # expert 0: rows 1 and 5, then padding
    assert sorted_ids[4:8].tolist() == [3, n, n, n]
    assert sorted_ids[8:12].tolist() == [0, 2, 4, n]
    assert block_expert[:3].tolist() == [0, 1, 3]
    assert (sorted_ids[12:] == n).all()  # the worst case's tail: idle blocks


def test_tuning_table_picks_by_rows_per_expert():
    from plugins.moe.triton.tuning import TABLE, pick

    assert pick("sm90", 0.5) == TABLE["sm90"][0][1]  # decode: short tiles
    assert pick("sm90", 10_000) == TABLE["sm90"][-1][1]
    assert pick("unknown-arch", 1) == TABLE["sm80"][0][1]
    for entries in TABLE.values():
        assert entries[-1][0] is None  # every arch has a catch-all


@triton_only
def test_tiny_qwen3_moe_through_triton_matches_torch_native(tmp_path, registry):
    """The whole model with the triton runner (interpreter on a CPU) against torch_native."""
    from model_fixtures import PagedHarness, cpu_plan, torch_native_backend, write_config_model

    from core.config import make_server_args
    from core.loader import load_model

    config = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=96, head_dim=16,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                  vocab_size=260, max_position_embeddings=128, torch_dtype="float32")
    path = write_config_model(tmp_path / "m", config)
    args = make_server_args(model_path=path, load_format="dummy")
    plan = cpu_plan("qwen3_moe", page_size=4)
    logits = {}
    for runner in ("torch_native", "triton"):
        model = load_model(args, dataclasses.replace(plan, moe_runner=runner), registry)
        cfg = model.hf_config
        h = PagedHarness(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, 4,
                         backend=torch_native_backend(cfg, page_size=4))
        with torch.inference_mode():
            out = []
            b = h.batch([0], [[5, 17, 99, 3, 250]])
            out.append(model.model.compute_logits(model.model(b.input_ids, b.positions, b)))
            for t in (7, 8):
                b = h.batch([0], [[t]], decode=True)
                out.append(model.model.compute_logits(model.model(b.input_ids, b.positions, b)))
        logits[runner] = torch.cat(out)
    torch.testing.assert_close(logits["triton"], logits["torch_native"], rtol=1e-4, atol=1e-4)
