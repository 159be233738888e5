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


# ---- real-size layers, bf16: DeepSeek-V3's noaux_tc routing and GPT-OSS's experts (issues 34,
# 35) on the triton runner against torch_native (fp32 accumulation) on the same GPU ----

# (name, experts, top_k, hidden, inter, groups, correction bias, activation, expert biases)
REAL_LAYERS = [
    ("deepseek-v3", 256, 8, 7168, 2048, (8, 4), True, "silu", False),
    ("kimi-k2", 384, 8, 7168, 2048, None, True, "silu", False),  # one group: routing kernels
    ("gpt-oss-120b", 128, 4, 2880, 2880, None, False, "swigluoai", True),
]


def _real_layer(name, E, k, H, inter, groups, cbias, act, biased, tokens, seed=0):
    """Weights drawn on the GPU in bf16; router logits and the correction bias drawn as the
    conformance suite draws them (every routing choice won by a margin, the bias moving most
    tokens' experts), so both runners must pick the same experts."""
    from conformance.moe_cases import MoECase
    from conformance.moe_check import draw_correction_bias, routing_logits
    from core.contract.moe import MoELayerParams, MoEWeights

    case = MoECase(tokens, E, k, H, inter, scoring="sigmoid" if cbias else "softmax",
                   groups=groups, correction_bias=cbias, shared=cbias)
    gen = torch.Generator().manual_seed(seed)
    logits = routing_logits(case, gen)
    bias = draw_correction_bias(case, logits, gen).cuda() if cbias else None
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = torch.bfloat16
    w13 = torch.randn(E, 2 * inter, H, generator=g, device="cuda", dtype=bf16) * H ** -0.5
    w2 = torch.randn(E, H, inter, generator=g, device="cuda", dtype=bf16) * inter ** -0.5
    extra = {}
    if biased:
        extra = {"w13_bias": torch.randn(E, 2 * inter, generator=g, device="cuda") * 0.5,
                 "w2_bias": torch.randn(E, H, generator=g, device="cuda") * 0.5}
    layer = MoELayerParams(0, E, k, H, inter, renormalize=True, scoring_func=case.scoring,
                           grouped_topk=groups, routed_scaling_factor=2.5 if cbias else 1.0,
                           activation=act, correction_bias=bias)
    x = torch.randn(tokens, H, generator=g, device="cuda", dtype=bf16)
    shared = (torch.randn(tokens, H, generator=g, device="cuda", dtype=bf16) * 0.5
              if cbias else None)
    return x, logits.cuda(), MoEWeights(w13.contiguous(), w2.contiguous(), extra=extra), \
        layer, shared


@pytest.mark.parametrize("spec", REAL_LAYERS, ids=[s[0] for s in REAL_LAYERS])
def test_real_size_bf16_layers_on_triton_match_torch_native(spec):
    import dataclasses

    from core.plan.registry import get_registry

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    registry = get_registry()
    triton_runner = registry.get("moe", "triton").load()()
    native = registry.get("moe", "torch_native").load()()
    for tokens in (1, 16, 128, 1024):
        x, logits, weights, layer, shared = _real_layer(*spec, tokens=tokens)
        want = native.forward(x, logits, weights, layer, shared).float()
        got = triton_runner.forward(x, logits, weights, layer, shared)
        torch.cuda.synchronize()
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 2e-2, (spec[0], tokens, err)
        # what is being checked matters at this size: without the correction bias (or with
        # SiLU in place of swigluoai) the output is far off
        wrong = (dataclasses.replace(layer, correction_bias=None) if spec[6]
                 else dataclasses.replace(layer, activation="silu"))
        off = native.forward(x, logits, weights, wrong, shared).float()
        assert ((off - want).norm() / want.norm()).item() > 10 * 2e-2, (spec[0], tokens)
        del x, logits, weights, want, got, off
        torch.cuda.empty_cache()
