"""MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE), loaded through core.engine.loader from tiny
random transformers checkpoints, match transformers' logits in fp32 on the CPU.

Same harness as test_models.py (paged KV cache, page size 4, scattered pages, torch_native
attention) with the torch_native MoE runner: prefill, then every decode step teacher-forced (past
Mixtral's window), and a ragged batch of two. Also: fused-expert checkpoint names, dummy weights,
the registry and the model spec of each architecture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_fixtures import (
    PagedHarness,
    cpu_plan,
    torch_native_backend,
    write_config_model,
    write_tokenizer,
)

from core.engine.loader import load_model
from core.plan.args import make_server_args
from core.plan.model_spec import moe_layer_ids, spec_from_config
from core.plan.registry import build_registry

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
PAGE = 4
RTOL = 1e-4
WINDOW = 8  # Mixtral's window here: short, so that the decode steps cross it


def tiny_moe_config(arch: str):
    import transformers

    common = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256,
                  eos_token_id=258, pad_token_id=259)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=WINDOW, head_dim=16)
    if arch == "qwen2_moe":  # layer 1 dense (mlp_only_layers), a shared expert behind its gate
        return transformers.Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48,
                                           decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3,
                                           moe_intermediate_size=32, norm_topk_prob=True,
                                           head_dim=32)
    raise ValueError(arch)


def tiny_moe_hf_model(arch: str, seed: int = 0):
    import transformers

    cls = {"mixtral": transformers.MixtralForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(tiny_moe_config(arch)).float().eval()
    with torch.no_grad():
        # HF's init (std 0.02) gives near-uniform logits and routing; larger weights make the
        # comparison sharper and the routing decisive.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1))
    return model


def moe_plan(impl: str):
    return dataclasses.replace(cpu_plan(impl, page_size=PAGE), moe_runner="torch_native")


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory, registry):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf = tiny_moe_hf_model(arch)
    hf.save_pretrained(str(path), safe_serialization=True)  # per-expert tensor names
    write_tokenizer(path)
    loaded = load_model(make_server_args(model_path=str(path), load_format="safetensors"),
                        moe_plan(arch), registry)
    return loaded.model, hf, loaded.hf_config


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def step(model, batch):
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def assert_close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def harness(config):
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    return PagedHarness(config.num_hidden_layers, config.num_key_value_heads, head_dim, PAGE,
                        backend=torch_native_backend(config, page_size=PAGE))


def test_prefill_then_every_decode_step(pair):
    model, hf, config = pair
    ids = tokens(2 * WINDOW + 6, seed=1)  # 22 tokens: 12 prefilled, 10 decoded
    ref = hf_logits(hf, ids)
    h = harness(config)
    assert_close(step(model, h.batch([0], [ids[:12]])), ref[:12])
    for t in range(12, len(ids)):
        assert_close(step(model, h.batch([0], [[ids[t]]], decode=True))[0], ref[t])


def test_ragged_batch_of_two(pair):
    model, hf, config = pair
    a, b = tokens(15, seed=2), tokens(11, seed=3)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    h = harness(config)
    out = step(model, h.batch([0, 1], [a[:7], b[:9]]))
    assert_close(out[:7], ref_a[:7])
    assert_close(out[7:], ref_b[:9])
    for i in range(2):
        out = step(model, h.batch([0, 1], [[a[7 + i]], [b[9 + i]]], decode=True))
        assert_close(out[0], ref_a[7 + i])
        assert_close(out[1], ref_b[9 + i])


def test_layer_kinds(pair):
    """Which layers hold experts, and the routing each architecture asks of the runner."""
    model, hf, config = pair
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    arch = config.model_type
    if arch == "qwen2_moe":
        assert kinds == ["SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]
        block = model.model.layers[0].mlp
        assert hasattr(block, "shared_expert") and not block.params.renormalize
    else:
        assert kinds == ["SparseMoeBlock"] * 3
        assert model.model.layers[0].mlp.params.renormalize
        assert not hasattr(model.model.layers[0].mlp, "shared_expert")
    if arch == "mixtral":
        assert [layer.self_attn.attn.params.sliding_window for layer in model.model.layers] \
            == [WINDOW] * 3


def test_fused_expert_names_load_the_same(pair):
    """transformers >= 5 keeps experts fused in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); a checkpoint written that way loads into the same weights."""
    model, hf, config = pair
    state = hf.state_dict()
    if not any(k.endswith("experts.gate_up_proj") for k in state):
        pytest.skip("this transformers keeps experts unfused in memory")
    fresh = type(model)(config, model.ctx)
    fresh.load_weights(state.items())
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_missing_expert_is_named(tmp_path, registry):
    hf = tiny_moe_hf_model("qwen3_moe")
    model = load_model(make_server_args(model_path=str(_save(hf, tmp_path)),
                                        load_format="safetensors"),
                       moe_plan("qwen3_moe"), registry).model
    weights = {k: v for k, v in _per_expert_state(tmp_path).items()
               if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.w13_weight"
                                         r"\[5\.up\]"):
        model.load_weights(weights.items())


def _save(hf, path):
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return path


def _per_expert_state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


QWEN3_30B_A3B_SHAPE = {  # Qwen3-30B-A3B's config.json, shrunk in width and depth
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 260, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}


def test_dummy_weights_from_a_config(tmp_path, registry):
    path = write_config_model(tmp_path / "q3moe", QWEN3_30B_A3B_SHAPE)
    loaded = load_model(make_server_args(model_path=path, load_format="dummy"),
                        moe_plan("qwen3_moe"), registry)
    h = harness(loaded.hf_config)
    logits = step(loaded.model, h.batch([0], [tokens(5, seed=9)]))
    assert logits.shape == (5, 260) and torch.isfinite(logits).all()


def test_models_are_registered(registry):
    caps = {name: reg.caps.architectures for name, reg in registry.kind("models").items()}
    assert caps["mixtral"] == {"MixtralForCausalLM"}
    assert caps["qwen2_moe"] == {"Qwen2MoeForCausalLM"}
    assert caps["qwen3_moe"] == {"Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("arch", ARCHS)
def test_model_spec_describes_the_experts(arch):
    spec = spec_from_config(tiny_moe_config(arch))
    moe = spec.moe
    if arch == "mixtral":
        assert (moe.num_experts, moe.top_k, moe.renormalize) == (4, 2, True)
        assert spec.sliding_windows == (WINDOW,) * 3 and moe.moe_layers == (0, 1, 2)
    elif arch == "qwen2_moe":
        assert (moe.num_experts, moe.top_k, moe.renormalize) == (6, 2, False)
        assert (moe.num_shared_experts, moe.shared_expert_intermediate_size) == (1, 48)
        assert moe.shared_expert_gate and moe.moe_layers == (0, 2)
        assert moe.intermediate_size == 32
    else:
        assert (moe.num_experts, moe.top_k, moe.renormalize) == (8, 3, True)
        assert moe.num_shared_experts == 0 and not moe.shared_expert_gate
    assert moe.scoring_func == "softmax"


@pytest.mark.parametrize("step, dense", [(1, [1]), (2, []), (2, [3]), (3, [0, 2])])
def test_the_model_puts_experts_where_the_spec_does(step, dense):
    """Qwen2MoeForCausalLM reads its MoE layers from the config itself (a plugin imports no
    core.plan): the layers the plan's spec counts."""
    import transformers

    from plugins.models.qwen2_moe import Qwen2MoeForCausalLM

    config = transformers.Qwen2MoeConfig(num_hidden_layers=6, num_experts=4,
                                         decoder_sparse_step=step, mlp_only_layers=dense)
    assert Qwen2MoeForCausalLM.moe_layers(config) == spec_from_config(config).moe.moe_layers


def test_moe_layer_ids():
    assert moe_layer_ids(6, 2) == (1, 3, 5)  # Qwen2-MoE counts layers from 1
    assert moe_layer_ids(4, 1, [0, 3]) == (1, 2)
    assert moe_layer_ids(5, None, None, first_k_dense=2) == (2, 3, 4)  # DeepSeek


def test_weights_packed_for_cpu(pair):
    """What the model runner does on a CPU (oneDNN-packed linears, the router and the shared
    expert included; stacked experts left for the runner) gives the same logits."""
    import copy

    from plugins.hardware.cpu_runtime import pack_model as pack_for_cpu

    model, hf, config = pair
    packed = copy.deepcopy(model)
    pack_for_cpu(packed)
    ids = tokens(9, seed=5)
    ref = hf_logits(hf, ids)
    h = harness(config)
    assert_close(step(packed, h.batch([0], [ids[:6]])), ref[:6])
    for t in range(6, 9):
        assert_close(step(packed, h.batch([0], [[ids[t]]], decode=True))[0], ref[t])
