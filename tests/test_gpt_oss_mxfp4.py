"""GPT-OSS checkpoints with MXFP4 experts (OpenAI's released layout) through the model's loader
(plugins/models/gpt_oss.py) and the engine, against transformers fp32 on the dequantized weights.

The checkpoint is written here: transformers' tiny random GptOssForCausalLM
(tests/model_fixtures.py "gpt_oss", intermediate size 64 so that both projections' rows split
into blocks of 32), its experts quantized by the quantizer below (independent of the project's:
per block of 32 values along a row, a shared E8M0 exponent floor(log2(amax)) - 2 and each value
the nearest e2m1 magnitude, saturated at 6), stored as `gate_up_proj_blocks` uint8
[E, 2I, H/32, 16] (two codes a byte, low nibble first) and `_scales` uint8 [E, 2I, H/32], rows
interleaved gate / up, `down_proj_*` alike over [E, H, I/32], biases bf16; config.json with
quantization_config {"quant_method": "mxfp4"}. transformers' own MXFP4 loader
(Mxfp4Config(dequantize=True)) reads that file as this test dequantizes it, which pins the layout
to HF's. The reference model is the same HF model with the test's dequantized experts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_compare import check, greedy, run
from model_fixtures import tiny_hf_model, write_tokenizer

from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args

QUANT_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
INTER = 64  # the fixture's 48 is not a multiple of 32
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((29, 11))]
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ---- the test's own MXFP4 (OCP MX v1.0: e2m1 elements, one E8M0 scale per 32) ----

def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    *lead, k = w.shape
    x = w.double().reshape(*lead, k // 32, 32)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    magnitude = (scaled.abs().clamp(max=6.0)[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = magnitude | ((scaled < 0).long() << 3)  # bit 3: the sign
    pairs = codes.reshape(*lead, k // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # element 2j: low nibble
    return blocks, (exp + 127).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks [..., G, 16], scales [..., G]) -> fp32 [..., 32 G], exactly."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).long().flatten(-2)  # [..., G, 32]
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    values = sign * E2M1_MAGNITUDES[codes & 7]
    out = values * torch.exp2(scales.double() - 127)[..., None]
    return out.flatten(-2).float()


def write_mxfp4_gpt_oss(path: Path, seed: int = 0):
    """The checkpoint described in the module docstring -> (path, the HF reference model with
    the dequantized experts, {HF expert name: its dequantized tensor in HF's layout})."""
    from safetensors.torch import save_file

    hf = tiny_hf_model("gpt_oss", seed, intermediate_size=INTER)
    state, dequantized = {}, {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # HF's [E, K, N] -> stored output-major [E, N, K]: gate_up rows 2i gate, 2i + 1 up
            blocks, scales = quantize(t.transpose(1, 2))
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            dequantized[name] = dequantize(blocks, scales).transpose(1, 2).contiguous()
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            state[name] = t.bfloat16()  # as released
            dequantized[name] = state[name].float()
        else:
            state[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return path, hf, dequantized


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m")


def _plan(path, **kw):
    return make_plan(make_server_args(model_path=str(path), dtype="float32", **kw))


def _dense(plan):
    """The plan with dense experts (the resolver does not make it: see the refusal test)."""
    return dataclasses.replace(plan, quant_method="unquantized", quant_format="dense")


def test_the_test_quantizer_is_close_and_decodes_its_own_codes():
    """The quantizer's error is what 4 bits allow (at most a quarter of a block's largest
    magnitude), and known values encode as the spec says."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=gen) * torch.logspace(-3, 1, 8)[:, None]
    blocks, scales = quantize(w)
    err = (dequantize(blocks, scales) - w).abs().reshape(8, 4, 32)
    assert (err <= w.abs().reshape(8, 4, 32).amax(-1, keepdim=True) / 4).all()
    # 1.0 and -0.5 in a block whose amax is 6 (scale byte 127 + 0): codes 2 and 9
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1], row[0, 2] = 1.0, -0.5, 6.0
    blocks, scales = quantize(row)
    assert scales.tolist() == [[127]] and blocks[0, 0, 0].item() == 0x92
    assert blocks[0, 0, 1].item() == 0x07  # 6.0 in the low nibble, 0 in the high one
    assert torch.equal(dequantize(blocks, scales), row)


def test_transformers_reads_the_file_as_the_test_dequantizes_it(ckpt):
    """transformers' own MXFP4 loader, dequantizing, gives exactly the test's expert weights:
    the file is OpenAI's layout as HF reads it."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    path, _, dequantized = ckpt
    model = GptOssForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    params = dict(model.named_parameters())
    for name, want in dequantized.items():
        assert torch.equal(params[name].detach().float(), want), name


def test_resolve_plans_mxfp4_and_keeps_the_experts_packed(ckpt):
    """The resolver plans the mxfp4 method for the checkpoint; the loader keeps the file's
    bytes (gate rows, then up rows) and their decoding equals the test's dequantization."""
    from plugins._kit import mxfp4

    path, _, dequantized = ckpt
    args, plan, _, registry = _plan(path)
    assert (plan.quant_method, plan.quant_format, plan.moe_runner) == ("mxfp4", "mxfp4",
                                                                      "torch_native")
    loaded = load_model(args, plan, registry)
    assert any("kept packed" in n for n in loaded.notes), loaded.notes
    for i, layer in enumerate(loaded.model.model.layers):
        w = layer.mlp.weights()
        assert w.form == "mxfp4" and w.w13.dtype == w.w2.dtype == torch.uint8
        name = f"model.layers.{i}.mlp.experts."
        gate_up = dequantized[name + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H] interleaved
        down = dequantized[name + "down_proj"].transpose(1, 2)  # [E, H, I]
        for e in range(gate_up.shape[0]):
            w13 = mxfp4.dequantize(w.w13[e], w.extra["w13_scale"][e])
            assert torch.equal(w13, torch.cat((gate_up[e, 0::2], gate_up[e, 1::2])))
            assert torch.equal(mxfp4.dequantize(w.w2[e], w.extra["w2_scale"][e]), down[e])
        bias = dequantized[name + "gate_up_proj_bias"]
        assert torch.equal(w.extra["w13_bias"], torch.cat((bias[:, 0::2], bias[:, 1::2]), 1))
        assert torch.equal(w.extra["w2_bias"], dequantized[name + "down_proj_bias"])


def test_dense_experts_are_the_exact_dequantization(ckpt):
    """With the dense method the loader dequantizes each blocks / scales pair: w13 / w2 equal
    the test's dequantized weights, transposed and de-interleaved, and the load says so."""
    path, _, dequantized = ckpt
    args, plan, _, registry = _plan(path)
    loaded = load_model(args, _dense(plan), registry)
    assert any("mxfp4 experts of 3 MoE layers dequantized to float32" in n
               for n in loaded.notes), loaded.notes
    for i, layer in enumerate(loaded.model.model.layers):
        w = layer.mlp.weights()
        assert w.form == "unquantized" and w.w13.dtype == torch.float32
        gate_up = dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, H, 2I]
        assert torch.equal(w.w13, torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]),
                                            -1).transpose(1, 2))
        assert torch.equal(w.w2, dequantized[f"model.layers.{i}.mlp.experts.down_proj"]
                           .transpose(1, 2))


@pytest.mark.parametrize("experts", ["mxfp4", "dense"])
def test_served_tokens_and_logprobs_match_hf(ckpt, experts):
    """Greedy tokens, each decode step's logprob and every prompt position's, within 1e-4 of
    HF fp32 on the dequantized weights; prompts past the window of 8, chunked prefill."""
    path, hf, _ = ckpt
    args, plan, spec, registry = _plan(path, max_total_tokens=1024, chunked_prefill_size=8,
                                       page_size=4)
    if experts == "dense":
        plan = _dense(plan)
    core = build_engine_core(args, plan, spec, registry, load_model(args, plan, registry))
    done = run(core.scheduler, [(f"p{i}", p, greedy(8, prompt_k=2))
                                for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        check(done[f"p{i}"], p, hf, prompt_logprobs=True)
    core.scheduler.check_accounting()


def test_core_resolve_plans_mxfp4(ckpt, capsys, clean_plugin_env):
    """`core resolve` on the checkpoint: mxfp4; asked for dense experts (--quantization
    unquantized), a refusal that says why."""
    from core.cli import main

    path = str(ckpt[0])
    assert main(["resolve", "--model-path", path, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["quant_method"], plan["quant_format"]) == ("mxfp4", "mxfp4")
    assert plan["model_impl"] == "gpt_oss"
    assert main(["resolve", "--model-path", path, "--quantization", "unquantized"]) == 1
    out = capsys.readouterr().out
    assert "--quantization unquantized conflicts with the checkpoint: its quantization_config " \
           "says quant_method=mxfp4" in out, out


def test_a_blocks_tensor_without_its_scales_is_named(ckpt):
    """A blocks tensor without its scales is refused by name: packed, the scales parameter is
    missing; dense, the pair is incomplete."""
    from safetensors.torch import load_file

    path, _, _ = ckpt
    args, plan, _, registry = _plan(path)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    for p, message in ((plan, r"missing tensors: model\.layers\.1\.mlp\.w2_scales"),
                       (_dense(plan), r"MXFP4 blocks and scales come in pairs; alone: "
                                      r"model\.layers\.1\.mlp\.experts\.down_proj_blocks")):
        loaded = load_model(args, p, registry)
        model = type(loaded.model)(loaded.hf_config, loaded.model.ctx)  # before processing
        with pytest.raises(ValueError, match=message):
            model.load_weights(state.items())


def test_mxfp4_experts_are_not_cast_into_another_form(ckpt):
    """Experts a method keeps in a form of its own (here fp8 parameters where the dense ones
    were) are refused by name: a dequantized pair is never cast into them."""
    from safetensors.torch import load_file

    path, _, _ = ckpt
    args, plan, _, registry = _plan(path)
    loaded = load_model(args, _dense(plan), registry)
    model = type(loaded.model)(loaded.hf_config, loaded.model.ctx)
    for layer in model.model.layers:
        layer.mlp.w13_weight = torch.nn.Parameter(
            layer.mlp.w13_weight.data.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_blocks: "
                                         r"MXFP4 experts load kept packed \(quant method mxfp4\) "
                                         r"or dequantized into dense experts"):
        model.load_weights(load_file(str(path / "model.safetensors")).items())
