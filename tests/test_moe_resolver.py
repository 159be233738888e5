"""The MoE slot with the built-in runners: the plan for real MoE configs on simulated devices,
and MoECaps fields as rejection reasons."""

from __future__ import annotations

import pytest

from core.contract.capabilities import MoECaps
from core.plan.args import ServerArgs
from core.plan.checks import check_moe
from core.plan.devices import PROFILES
from core.plan.model_spec import spec_from_config
from core.plan.registry import get_registry
from core.plan.resolver import resolve

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
