"""MoE models end to end on a CUDA device (issue 13): the resolver picks the `triton` MoE runner,
and greedy output of a random-weight Qwen3-MoE-shaped model (Qwen3-30B-A3B's layer shapes, fewer
layers) equals the `torch_native` runner's on the same GPU, in fp32, for 64 tokens.

Run with `pytest -m gpu tests/test_moe_gpu.py` on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

QWEN3_MOE_4L = {  # Qwen3-30B-A3B's public config with 4 of its 48 layers
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from model_fixtures import write_config_model

    return write_config_model(tmp_path_factory.mktemp("qwen3moe"), QWEN3_MOE_4L)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 150000) for _ in range(n)] for n in (1, 7, 130, 1000)]


def _run(model_dir: str, dtype: str, runner: str | None) -> tuple[str, list[list[int]]]:
    from core import Engine

    kwargs = {"moe_runner_backend": runner} if runner else {}
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    with Engine(model_dir, load_format="dummy", device="cuda", dtype=dtype,
                max_total_tokens=8192, **kwargs) as engine:
        chosen = engine.plan.moe_runner
        outs = engine.generate(input_ids=_prompts(), sampling_params=params)
    return chosen, [o["output_ids"] for o in outs]


def test_resolver_picks_triton_and_greedy_equals_torch_native(model_dir):
    chosen, triton_out = _run(model_dir, "float32", None)
    assert chosen == "triton"
    _, native_out = _run(model_dir, "float32", "torch_native")
    assert all(len(o) == 64 for o in triton_out)
    assert triton_out == native_out


def test_bf16_serves_on_triton(model_dir):
    chosen, out = _run(model_dir, "bfloat16", None)
    assert chosen == "triton" and all(len(o) == 64 for o in out)
