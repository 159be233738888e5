"""Shared layers against transformers' own formulas, and the torch_native MoE runner against a
dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.contract.moe import MoELayerParams, MoEWeights
from core.layers import (
    GatedAct,
    Linear,
    LMHead,
    ModelContext,
    MoE,
    RMSNorm,
    RotaryEmbedding,
    UnquantizedLinearMethod,
    VocabEmbedding,
    apply_rotary,
    rope_parameters,
)
from core.layers.rotary import inv_frequencies
from plugins.moe.torch_native.runner import TorchNativeMoE, select_experts


def test_model_context_defaults_and_frozen():
    ctx = ModelContext()
    assert ctx.dtype == torch.float32 and ctx.device is None  # None: torch's default device
    assert isinstance(ctx.quant_method, UnquantizedLinearMethod) and ctx.moe_runner is None
    assert type(ctx.ops).__name__ == "TorchLayerOps"  # the reference layer ops
    with pytest.raises(AttributeError):
        ctx.dtype = torch.float16


def test_rmsnorm_matches_hf_and_fuses_the_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, r = torch.randn(5, 32), torch.randn(5, 32)
    ours, ref = RMSNorm(32, 1e-5), LlamaRMSNorm(32, eps=1e-5)
    w = torch.randn(32)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), ref(x))
    normed, residual = ours(x, r)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, ref(x + r))
    half = RMSNorm(32, 1e-5, dtype=torch.bfloat16)
    half.weight.data.copy_(w)
    ref_half = ref.to(torch.bfloat16)
    torch.testing.assert_close(half(x.bfloat16()), ref_half(x.bfloat16()))


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_inv_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=512,
                      rope_parameters=dict(params))
    ours = inv_frequencies(32, rope_parameters(cfg), 512)
    if params["rope_type"] == "default":
        ref = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float())


def test_old_style_rope_config():
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    p = rope_parameters(Old())
    assert p["rope_type"] == "linear" and p["rope_theta"] == 1234.0
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        inv_frequencies(16, {"rope_type": "longrope", "rope_theta": 1.0}, 8)


@pytest.mark.parametrize("scaling", [
    {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2(-Lite)
    {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16},
    {"factor": 8.0}])  # no mscales: YaRN's default attention factor
def test_yarn_matches_hf(scaling):
    """DeepSeek's YaRN: inverse frequencies and cos/sin factor as transformers computes them,
    and the softmax mscale it folds into MLA's scale."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from core.layers.rotary import attention_factor, yarn_softmax_mscale

    params = {"rope_type": "yarn", "rope_theta": 10000.0,
              "original_max_position_embeddings": 4096, **scaling}
    cfg = transformers.DeepseekV2Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                        rope_parameters=dict(params))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = rope_parameters(cfg)
    torch.testing.assert_close(inv_frequencies(64, ours, 163840), inv.float())
    assert attention_factor(ours, 163840) == pytest.approx(factor)
    assert 0.5 * yarn_softmax_mscale(ours, 163840) == pytest.approx(
        yarn_apply_mscale(cfg.rope_parameters, 0.5))


def test_rotary_matches_hf_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    rot = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    pos = torch.tensor([0, 3, 7, 40])
    q, k = torch.randn(4, 3, 16), torch.randn(4, 1, 16)
    cos, sin = rot.cos_sin(pos, torch.float32)
    # HF layout: [batch, heads, seq, dim] with full-width cos/sin
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_ref[0].transpose(0, 1))


def test_rotary_table_grows_past_its_first_size():
    rot = RotaryEmbedding(8, {"rope_type": "default", "rope_theta": 10000.0}, 1 << 24)
    first = rot._cos.shape[0]
    cos, _ = rot.cos_sin(torch.tensor([first + 5]), torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    want = (torch.tensor(first + 5.0) * inv).cos()
    torch.testing.assert_close(cos[0, 0], torch.cat([want, want]))


def test_stacked_linear_shards():
    lin = Linear(4, [3, 2, 2], True, ModelContext(), shard_names=("q", "k", "v"))
    q, k, v = torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)
    for name, w in (("q", q), ("k", k), ("v", v)):
        lin.weight_loader(lin.weight, w, name)
        lin.weight_loader(lin.bias, torch.full((w.shape[0],), float(ord(name))), name)
    x = torch.randn(5, 4)
    out = lin(x)
    torch.testing.assert_close(out[:, 3:5], x @ k.t() + ord("k"))
    torch.testing.assert_close(out, x @ torch.cat([q, k, v]).t() + lin.bias)
    with pytest.raises(ValueError, match=r"expected shape \(2, 4\), got \(3, 4\)"):
        lin.weight_loader(lin.weight, q, "v")
    with pytest.raises(KeyError):
        lin.weight_loader(lin.weight, q, "o")


def test_gated_act_and_lm_head_softcap():
    x = torch.randn(3, 8)
    torch.testing.assert_close(GatedAct("silu")(x), F.silu(x[:, :4]) * x[:, 4:])
    with pytest.raises(ValueError, match="unsupported activation"):
        GatedAct("relu6")
    emb = VocabEmbedding(10, 4, torch.float32)
    emb.weight.data.normal_()
    head = LMHead(10, 4, torch.float32, tie_to=emb, final_logit_softcap=0.5)
    assert head.weight is emb.weight
    h = torch.randn(2, 4) * 10
    logits = head(h)
    torch.testing.assert_close(logits, torch.tanh((h @ emb.weight.t()) / 0.5) * 0.5)
    assert logits.abs().max() <= 0.5


# MoE


def dense_moe(hidden, logits, w13, w2, top_k, renormalize, act=F.silu):
    """Every expert on every token, weighted by a dense routing matrix (zeros off the top-k)."""
    probs = torch.softmax(logits.double(), -1)
    top = probs.topk(top_k, -1)
    route = torch.zeros_like(probs).scatter(1, top.indices, top.values)
    if renormalize:
        route = route / route.sum(-1, keepdim=True)
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        h = hidden.double() @ w13[e].double().t()
        y = (act(h[:, :inter]) * h[:, inter:]) @ w2[e].double().t()
        out += route[:, e:e + 1] * y
    return out


@pytest.mark.parametrize("top_k,renormalize", [(1, False), (2, True), (3, False)])
def test_torch_native_moe_matches_dense(top_k, renormalize):
    g = torch.Generator().manual_seed(top_k)
    T, H, inter, E = 13, 16, 24, 6
    hidden = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g) * 2
    w13 = torch.randn(E, 2 * inter, H, generator=g) / 4
    w2 = torch.randn(E, H, inter, generator=g) / 4
    layer = MoELayerParams(0, E, top_k, H, inter, renormalize=renormalize)
    out = TorchNativeMoE().forward(hidden, logits, MoEWeights(w13, w2), layer)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_moe(hidden, logits, w13, w2, top_k,
                                                       renormalize), rtol=1e-5, atol=1e-5)


def test_moe_gelu_activation():
    g = torch.Generator().manual_seed(9)
    hidden, logits = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    layer = MoELayerParams(0, 4, 2, 8, 6, activation="gelu")
    out = TorchNativeMoE().forward(hidden, logits, MoEWeights(w13, w2), layer)
    torch.testing.assert_close(out.double(), dense_moe(hidden, logits, w13, w2, 2, True,
                                                       act=F.gelu), rtol=1e-5, atol=1e-5)


def test_grouped_topk_keeps_experts_of_the_best_groups():
    # 8 experts in 4 groups of 2; only the 2 best groups (by best expert) stay eligible.
    logits = torch.tensor([[5.0, 0.0, 0.1, 4.9, 4.8, 4.7, 3.0, 0.0]])
    weights, ids = select_experts(logits, 3, False, grouped_topk=(4, 2))
    # groups: (0,1) best 5.0, (2,3) 4.9, (4,5) 4.8, (6,7) 3.0 -> keep groups 0 and 1
    assert sorted(ids[0].tolist()) == [0, 2, 3]
    free_w, free_ids = select_experts(logits, 3, False)
    assert sorted(free_ids[0].tolist()) == [0, 3, 4]
    torch.testing.assert_close(weights[0, 0], free_w[0, 0])


def test_moe_layer_delegates_to_the_runner():
    ctx = ModelContext(moe_runner=TorchNativeMoE())
    layer = MoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, ctx=ctx)
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(4, 8, generator=g)
    layer.gate.weight_loader(layer.gate.weight, gate)
    experts = {}
    for e in range(4):
        for proj, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
            experts[e, proj] = torch.randn(*shape, generator=g)
            layer.expert_weight_loader(experts[e, proj], e, proj)
    with pytest.raises(ValueError, match="expert 0 down_proj: expected shape"):
        layer.expert_weight_loader(torch.zeros(6, 8), 0, "down_proj")
    x = torch.randn(5, 8, generator=g)
    w13 = torch.stack([torch.cat([experts[e, "gate_proj"], experts[e, "up_proj"]])
                       for e in range(4)])
    w2 = torch.stack([experts[e, "down_proj"] for e in range(4)])
    torch.testing.assert_close(layer(x).double(), dense_moe(x, x @ gate.t(), w13, w2, 2, True),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no MoE runner"):
        MoE(4, 2, 8, 6, ModelContext())
