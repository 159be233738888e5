"""FP8 MoE experts: a tiny Qwen3-MoE checkpoint in the Qwen3-FP8 block format (tensors from
compressed-tensors' quantizer under the real per-expert names) loaded by core and run through
the torch_native runner; and online fp8 of a dense MoE checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from model_fixtures import PagedHarness, cpu_plan, torch_native_backend, write_tokenizer

from conformance.quant_refs import _ct_quantize, fake_quant_acts
from core.engine.loader import load_model
from core.plan.args import ServerArgs, make_server_args
from core.plan.devices import PROFILES
from core.plan.model_spec import load_model_spec
from core.plan.plan import ResolveError
from core.plan.registry import build_registry
from core.plan.resolver import resolve

FIXTURES = Path(__file__).parent / "fixtures"

QWEN3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def _tiny_qwen3_moe(seed: int = 0):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=260, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=258,
        pad_token_id=259)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                p.copy_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
    return model


def _is_quantized(name: str) -> bool:
    return name.endswith("_proj.weight") and "embed" not in name


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(directory, the HF model holding the dequantized weights)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("qwen3moe_fp8")
    hf = _tiny_qwen3_moe()
    tensors = {}

    def put(name: str, w: torch.Tensor) -> torch.Tensor:
        q, scale, deq = _ct_quantize(w.float(), "float", "block", (128, 128))
        tensors[name] = q
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale
        return deq

    inter = hf.config.moe_intermediate_size
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], in memory fused
                base = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):  # the checkpoints' own per-expert names
                    p[e, :inter] = put(f"{base}.{e}.gate_proj.weight", p[e, :inter])
                    p[e, inter:] = put(f"{base}.{e}.up_proj.weight", p[e, inter:])
            elif name.endswith("mlp.experts.down_proj"):
                base = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):
                    p[e] = put(f"{base}.{e}.down_proj.weight", p[e])
            elif _is_quantized(name):
                p.copy_(put(name, p))  # the reference model computes with what the file means
            else:
                tensors[name] = p.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    raw = hf.config.to_dict()
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    raw["quantization_config"] = QWEN3_FP8
    (path / "config.json").write_text(json.dumps(raw))
    write_tokenizer(path)
    return path, hf


def _logits(model, config, ids):
    h = PagedHarness(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4,
                     backend=torch_native_backend(config, page_size=4))
    batch = h.batch([0], [ids])
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch)).float()


def test_block_fp8_experts_load_and_match_the_dequantized_model(fp8_checkpoint):
    path, hf = fp8_checkpoint
    registry = build_registry()
    spec = load_model_spec(str(path))
    plan = resolve(spec, PROFILES["x86-cpu"], ServerArgs(dtype="float32"), registry)
    assert (plan.quant_method, plan.quant_format, plan.moe_runner) == ("fp8", "fp8_block",
                                                                       "torch_native")
    loaded = load_model(make_server_args(model_path=str(path), load_format="safetensors"),
                        dataclasses.replace(cpu_plan("qwen3_moe"), quant_method="fp8",
                                            quant_format="fp8_block",
                                            moe_runner="torch_native"), registry)
    moe = loaded.model.model.layers[0].mlp
    weights = moe.weights()
    assert weights.form == "fp8" and weights.w13.dtype == torch.float8_e4m3fn
    assert tuple(weights.extra["w13_scale"].shape) == (4, 2, 1)  # [E, 2I/128, H/128]

    # One MoE layer against an independent W8A8 reference: HF's dequantized experts, x
    # fake-quantized per 128-group by conformance.quant_refs.
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    hf_moe = hf.model.layers[0].mlp
    with torch.no_grad():
        logits = x @ hf_moe.gate.weight.t()
        probs = torch.softmax(logits.float(), -1)
        top_w, top_i = probs.topk(2, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        ref = torch.zeros(5, 128)
        gate_up = hf_moe.experts.gate_up_proj  # [E, 2I, H] (transformers 5 fuses experts)
        down = hf_moe.experts.down_proj  # [E, H, I]
        for t in range(5):
            for w, e in zip(top_w[t], top_i[t], strict=True):
                xq = fake_quant_acts(x[t:t + 1], "fp8_group")
                g, u = (xq @ gate_up[e].t()).chunk(2, -1)
                h = torch.nn.functional.silu(g) * u
                ref[t] += w * (fake_quant_acts(h, "fp8_group") @ down[e].t())[0]
        ours = moe(x)
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-4, err

    # The whole model against transformers on the dequantized weights: e4m3 activations (3
    # mantissa bits) put the logits ~8% off on this random model (measured 0.079); the exact
    # check is the layer above.
    ids = list(range(3, 40))
    ours = _logits(loaded.model, loaded.hf_config, ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert rel < 0.15 and agree > 0.75, (rel, agree)


def test_fp8_moe_picks_a_runner_that_runs_fp8_experts(fp8_checkpoint):
    """Block-scaled fp8 experts (the Qwen3-FP8 layout) run on the triton runner, which
    declares that format only; per-channel ones (online --quantization fp8) on torch_native,
    with triton's reason in the plan."""
    path, _ = fp8_checkpoint
    registry = build_registry()
    plan = resolve(load_model_spec(str(path)), PROFILES["h200"], ServerArgs(), registry)
    assert (plan.quant_method, plan.quant_format, plan.moe_runner) == \
        ("fp8", "fp8_block", "triton")
    spec = load_model_spec(str(FIXTURES / "configs" / "qwen3-30b-a3b.json"))
    online = resolve(spec, PROFILES["h200"], ServerArgs(quantization="fp8"), registry)
    assert (online.quant_format, online.moe_runner) == ("fp8_channel", "torch_native")
    triton = next(c for c in online.candidates if c.slot == "moe_runner" and c.name == "triton")
    assert not triton.fits and triton.reasons == (
        "fp8_channel experts not supported (runs fp8_block, mxfp4)",)
    with pytest.raises(ResolveError, match=r"fp8_channel experts not supported"):
        resolve(spec, PROFILES["h200"], ServerArgs(quantization="fp8",
                                                   moe_runner_backend="triton"), registry)


def test_online_fp8_of_a_dense_moe_checkpoint(tmp_path):
    hf = _tiny_qwen3_moe(seed=3)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path)
    registry = build_registry()
    args = make_server_args(model_path=str(tmp_path), load_format="safetensors")
    base = dataclasses.replace(cpu_plan("qwen3_moe"), moe_runner="torch_native")
    dense = load_model(args, base, registry)
    fp8 = load_model(args, dataclasses.replace(base, quant_method="fp8",
                                               quant_format="fp8_channel"), registry)
    assert fp8.model.model.layers[1].mlp.w2_weight.dtype == torch.float8_e4m3fn
    # The quantized layer against its own stored weights, dequantized here (per channel), with
    # x fake-quantized per token by conformance.quant_refs.
    moe, ref_moe = fp8.model.model.layers[1].mlp, dense.model.model.layers[1].mlp
    w = moe.weights()
    w13 = w.w13.float() * w.extra["w13_scale"]
    w2 = w.w2.float() * w.extra["w2_scale"]
    assert ((w13 - ref_moe.w13_weight).norm() / ref_moe.w13_weight.norm()) < 0.05
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        top_w, top_i = torch.softmax(moe.gate(x).float(), -1).topk(2, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        ref = torch.zeros(6, 128)
        for t in range(6):
            for wt, e in zip(top_w[t], top_i[t], strict=True):
                g, u = (fake_quant_acts(x[t:t + 1], "fp8_token") @ w13[e].t()).chunk(2, -1)
                h = torch.nn.functional.silu(g) * u
                ref[t] += wt * (fake_quant_acts(h, "fp8_token") @ w2[e].t())[0]
        err = ((moe(x) - ref).norm() / ref.norm()).item()
    assert err < 1e-4, err
    # The model: e4m3 weights and activations on this random model put the logits ~10% off
    # the dense run (measured 0.107); SmolLM2's perplexity (test_quant_accuracy) is the
    # accuracy check on real weights.
    ids = list(range(5, 50))
    a = _logits(dense.model, dense.hf_config, ids)
    b = _logits(fp8.model, fp8.hf_config, ids)
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.2, rel
