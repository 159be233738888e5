"""Quantization: configs of real checkpoints parsed into schemes, the resolver's choices and
refusals (capability, online, MoE agreement), ignore lists, the Triton block-scaled GEMM under
the interpreter, and the quant conformance suite on the CPU for the built-in methods."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

from conformance.quant_suite import *  # noqa: F401,F403 - the suite, on the CPU, in CI
from core.contract.capabilities import MoECaps, QuantCaps
from core.contract.quant import is_ignored, online_scheme, parse_quant_config
from core.plan.args import ServerArgs
from core.plan.checks import check_moe_quant
from core.plan.devices import PROFILES
from core.plan.plan import ResolveError
from core.plan.registry import build_registry
from core.plan.resolver import explain, resolve


@pytest.fixture(scope="module")
def registry():
    return build_registry()


QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [128, 128]}
CT_FP8_DYNAMIC = {  # as llm-compressor writes FP8_DYNAMIC checkpoints
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True}}}}
CT_W8A8 = {**CT_FP8_DYNAMIC, "format": "int-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                          "dynamic": True}}}}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": None}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}


def test_real_configs_parse_to_their_schemes():
    s = parse_quant_config(QWEN3_FP8)
    assert (s.format, s.block, s.activations, s.act_group) == ("fp8_block", (128, 128),
                                                               "dynamic", 128)
    s = parse_quant_config(CT_FP8_DYNAMIC)
    assert (s.format, s.activations, s.ignore) == ("fp8_channel", "dynamic", ("lm_head",))
    assert parse_quant_config(CT_W8A8).format == "int8_channel"
    s = parse_quant_config(AWQ)
    assert (s.format, s.weight_bits, s.group_size, s.zero_point) == ("int4_awq", 4, 128, True)
    s = parse_quant_config(GPTQ)
    assert (s.format, s.group_size, s.zero_point, s.checkpoint_format) == (
        "int4_gptq", 128, False, "gptq")
    assert parse_quant_config({"quant_method": "fbgemm_fp8"}).format == "fp8_channel"
    assert parse_quant_config(None).format == "dense"
    assert parse_quant_config({"quant_method": "mxfp4"}).format == "mxfp4"  # a plugin's own
    assert online_scheme("fp8_channel").online


@pytest.mark.parametrize("config,needle", [
    ({**GPTQ, "desc_act": True}, "desc_act"),
    ({**AWQ, "bits": 3}, "3 bits"),
    ({**AWQ, "version": "gemv"}, "gemv"),
    ({**QWEN3_FP8, "fmt": "e5m2"}, "e5m2"),
    ({**QWEN3_FP8, "activation_scheme": "static"}, "dynamic activations"),
    ({**CT_FP8_DYNAMIC, "config_groups": {"a": {}, "b": {}}}, "2 config_groups"),
    ({"activation_scheme": "dynamic"}, "no quant_method"),
])
def test_unservable_configs_say_which_field(config, needle):
    with pytest.raises(ValueError, match=needle):
        parse_quant_config(config)


def _spec(model_spec, quantization):
    from dataclasses import replace
    base = model_spec("qwen3-8b")
    return replace(base, quantization=quantization,
                   quant_method=quantization["quant_method"] if quantization else "none")


def test_qwen3_fp8_picks_fp8_on_h200_and_is_refused_before_sm89(model_spec, registry):
    spec = model_spec("qwen3-8b-fp8")
    plan = resolve(spec, PROFILES["h200"], ServerArgs(), registry)
    assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_block")
    assert "fp8 (fp8_block)" in explain(plan)
    for profile in ("a100", "t4"):
        with pytest.raises(ResolveError) as err:
            resolve(spec, PROFILES[profile], ServerArgs(), registry)
        text = str(err.value)
        assert "no quant method that loads fp8 checkpoints fits" in text
        assert "fp8: needs CUDA sm89+" in text, text


def test_online_quantization_of_a_dense_checkpoint(model_spec, registry):
    spec = model_spec("qwen3-8b")
    plan = resolve(spec, PROFILES["h200"], ServerArgs(quantization="fp8"), registry)
    assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_channel")
    assert any("quantizes the dense checkpoint at load" in n for n in plan.notes)
    # Never chosen on its own for a dense checkpoint.
    assert resolve(spec, PROFILES["h200"], ServerArgs(), registry).quant_method == "unquantized"
    plan = resolve(spec, PROFILES["x86-cpu"], ServerArgs(quantization="w8a8_int8"), registry)
    assert (plan.quant_method, plan.quant_format) == ("w8a8_int8", "int8_channel")


def test_quantization_flag_that_conflicts_with_the_checkpoint(model_spec, registry):
    with pytest.raises(ResolveError, match="conflicts with the checkpoint"):
        resolve(model_spec("qwen3-8b-fp8"), PROFILES["h200"],
                ServerArgs(quantization="w8a8_int8"), registry)


def test_format_a_method_lacks_is_a_reason(model_spec, registry):
    # compressed-tensors W8A8 int8: fp8 loads compressed-tensors but not int8 weights.
    plan = resolve(_spec(model_spec, CT_W8A8), PROFILES["h200"], ServerArgs(), registry)
    assert plan.quant_method == "w8a8_int8"
    fp8 = next(c for c in plan.candidates if c.slot == "quant_method" and c.name == "fp8")
    assert not fp8.fits and any("does not compute int8_channel" in r for r in fp8.reasons)


def test_moe_checkpoint_a_method_cannot_hold_is_refused_with_the_reason(model_spec, registry):
    from dataclasses import replace
    spec = replace(model_spec("qwen3-30b-a3b"), quantization=CT_W8A8,
                   quant_method="compressed-tensors")
    with pytest.raises(ResolveError) as err:
        resolve(spec, PROFILES["h200"], ServerArgs(), registry)
    assert "w8a8_int8: cannot quantize MoE expert weights" in str(err.value)
    # block fp8 experts are served, by the runner that runs them (tests/test_quant_moe.py)
    fp8 = replace(spec, quantization=QWEN3_FP8, quant_method="fp8")
    assert resolve(fp8, PROFILES["h200"], ServerArgs(), registry).moe_runner == "triton"


def test_moe_quant_agreement_from_either_side():
    runner = MoECaps(devices={"cuda"}, quant_methods={"unquantized"})
    quant = QuantCaps(devices={"cuda"}, moe_runners={"vendor_moe"})
    assert check_moe_quant("vendor_moe", runner, "vendor_q", quant) == []
    assert check_moe_quant("x", MoECaps(quant_methods={"vendor_q"}), "vendor_q", QuantCaps()) \
        == []
    assert check_moe_quant("x", runner, "vendor_q", quant) == [
        "quant method vendor_q not supported (supports unquantized); vendor_q runs its "
        "experts on vendor_moe"]


def test_ignore_lists_match_stacked_layers():
    assert is_ignored("model.layers.0.self_attn.qkv_proj",
                      ["re:.*self_attn.*"])
    assert is_ignored("model.layers.3.mlp.gate_up_proj",
                      ["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"])
    assert not is_ignored("model.layers.3.mlp.down_proj", ["lm_head"])
    assert is_ignored("model.layers.0.mlp.gate", ["re:.*mlp.gate$"])
    with pytest.raises(ValueError, match="cannot mix"):
        is_ignored("model.layers.0.self_attn.qkv_proj", ["q_proj"])


def test_ignored_layers_are_rebuilt_dense():
    import torch

    from core.contract.quant import apply_ignore
    from core.layers import Linear, ModelContext
    from core.layers.linear import DenseLinearMethod
    from plugins.quant.fp8.method import Fp8LinearMethod

    scheme = parse_quant_config({**QWEN3_FP8, "modules_to_not_convert": ["o_proj"]})
    ctx = ModelContext(dtype=torch.float32, quant_method=Fp8LinearMethod(scheme))
    model = torch.nn.Module()
    model.o_proj = Linear(128, 128, False, ctx)
    model.qkv_proj = Linear(128, [128, 128, 128], False, ctx, shard_names=["q", "k", "v"])
    assert model.o_proj.weight.dtype == torch.float8_e4m3fn
    dense = DenseLinearMethod(scheme)
    assert apply_ignore(model, scheme, dense) == ["o_proj"]
    assert model.o_proj.weight.dtype == torch.float32 and not hasattr(model.o_proj,
                                                                       "weight_scale_inv")
    assert model.qkv_proj.weight.dtype == torch.float8_e4m3fn


_KERNELS = textwrap.dedent("""
    import torch
    from plugins._kit.w8a8_triton import quantize_acts, scaled_mm, small_m_linear
    torch.manual_seed(0)

    def rel(y, ref):
        return ((y.float() - ref).norm() / ref.norm()).item()

    # int8 activation quantization, per row and per group (fp8 has no interpreter dtype)
    x = torch.randn(5, 300)
    q, s = quantize_acts(x, torch.int8)
    s_ref = x.abs().amax(1, keepdim=True) / 127
    assert torch.allclose(s, s_ref) and (q.float() - torch.round(x / s_ref)).abs().max() <= 1
    q, s = quantize_acts(x, torch.int8, group=64)
    g = torch.nn.functional.pad(x, (0, 20)).view(5, 5, 64)
    assert torch.allclose(s, g.abs().amax(-1) / 127)
    # ... and the same scales and codes, bit for bit, as the torch path (core.contract.quant.reciprocal:
    # x * (1 / scale)) on bf16-valued inputs, where x / scale often sits on a rounding midpoint
    from plugins._kit.quant_common import INT8_MAX, int8_acts, per_token_scale
    xb = (torch.randn(64, 512) * 3).to(torch.bfloat16).float()
    q, s = quantize_acts(xb, torch.int8)
    assert torch.equal(s, per_token_scale(xb, INT8_MAX))
    assert torch.equal(q, int8_acts(xb, s))

    # block-scaled GEMM, fp16 operands standing in for e4m3
    for m, n, k, block in ((1, 96, 256, (32, 64)), (37, 160, 192, (32, 64)), (5, 64, 96, (16, 32))):
        a = torch.randn(m, k).half(); b = torch.randn(n, k).half()
        sa = torch.rand(m, -(-k // block[1])) + 0.5
        sb = torch.rand(-(-n // block[0]), -(-k // block[1])) + 0.5
        bias = torch.randn(n).half()
        y = scaled_mm(a, sa, b, sb, block[0], block[1], torch.float32, bias)
        ea = sa.repeat_interleave(block[1], 1)[:, :k]
        eb = sb.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
        ref = (a.float() * ea) @ (b.float() * eb).t() + bias.float()
        assert rel(y, ref) < 1e-5, (m, n, k)

    # int8 per-row scales (W8A8 int8 prefill)
    a = torch.randint(-127, 128, (40, 160), dtype=torch.int8)
    b = torch.randint(-127, 128, (48, 160), dtype=torch.int8)
    sa, sb = torch.rand(40, 1) + 0.1, torch.rand(48, 1) + 0.1
    y = scaled_mm(a, sa, b, sb, 1, 160, torch.float32)
    assert rel(y, (a.float() * sa) @ (b.float() * sb).t()) < 1e-6

    # decode GEMV with the activation quantization fused in: int8, per token and static
    w = torch.randint(-127, 128, (80, 256), dtype=torch.int8)
    ws = torch.rand(80, 1) + 0.01
    for m in (1, 3, 16):
        x = torch.randn(m, 256)
        xs = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / xs).clamp(-127, 127)
        y = small_m_linear(x, w, ws, None, "token")
        assert rel(y, (xq * xs) @ (w.float() * ws).t()) < 2e-3, m
        st = torch.tensor(0.05)
        y = small_m_linear(x, w, ws, None, "static", input_scale=st)
        xq = torch.round(x / 0.05).clamp(-127, 127) * 0.05
        assert rel(y, xq @ (w.float() * ws).t()) < 2e-3, m
    # ... and block weights with per-group activations (fp16 standing in for e4m3)
    w = torch.randn(96, 256).half()
    wsb = torch.rand(3, 2) + 0.5
    x = torch.randn(4, 256)
    xg = x.view(4, 2, 128)
    sg = xg.abs().amax(-1, keepdim=True) / 448
    xd = ((xg / sg).half().float() * sg).view(4, 256)
    ew = wsb.repeat_interleave(32, 0).repeat_interleave(128, 1)
    y = small_m_linear(x, w, wsb, None, "group", (32, 128))
    assert rel(y, xd @ (w.float() * ew).t()) < 1e-5
    print("ok")
""")


def test_w8a8_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_KERNELS)


def test_kv_cache_scales_are_read_from_the_checkpoint(tmp_path):
    import dataclasses

    import torch
    from model_fixtures import cpu_plan, write_tiny_model
    from safetensors.torch import load_file, save_file

    from core.engine.loader import load_model
    from core.engine.memory.kv_cache import checkpoint_kv_scales
    from core.plan.args import make_server_args
    from plugins.models.weights import kv_scale_of

    assert kv_scale_of("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_of("model.layers.0.self_attn.v_proj.output_scale") == (0, "v")
    assert kv_scale_of("model.layers.0.self_attn.v_proj.weight") is None
    path = write_tiny_model("llama", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    layers = 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers."))
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.5])
    # a bias-free layer's zero bias (older AutoGPTQ exports) is skipped, not an error
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(tensors[
        "model.layers.0.self_attn.o_proj.weight"].shape[0])
    save_file(tensors, str(path / "model.safetensors"))
    registry = build_registry()
    loaded = load_model(make_server_args(model_path=str(path)),
                        dataclasses.replace(cpu_plan("llama")), registry)
    assert loaded.model.kv_cache_scales[layers - 1] == {"k": pytest.approx(0.01 * layers),
                                                         "v": 0.5}
    assert checkpoint_kv_scales(loaded.model, torch.float8_e4m3fn, loaded.notes) == (
        pytest.approx(0.01 * layers), 0.5)
    assert any("largest layer" in n for n in loaded.notes)
    assert checkpoint_kv_scales(loaded.model, torch.float32, loaded.notes) == (1.0, 1.0)
    assert any("scales are unused" in n for n in loaded.notes)
    # a non-zero bias the model has no place for is still refused
    tensors["model.layers.0.self_attn.o_proj.bias"] += 1
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors: model.layers.0.self_attn.o_proj.bias"):
        load_model(make_server_args(model_path=str(path)), cpu_plan("llama"), registry)


def test_dummy_weights_for_an_fp8_checkpoint(tmp_path):
    """--load-format dummy on an FP8 config (how the GPU benches run real shapes): e4m3
    weights drawn through fp32, scales at 1."""
    import dataclasses
    import json as _json

    import torch
    from model_fixtures import cpu_plan, tiny_config

    from core.engine.loader import load_model
    from core.plan.args import make_server_args

    cfg = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4).to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], quantization_config=QWEN3_FP8)
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    plan = dataclasses.replace(cpu_plan("llama"), quant_method="fp8", quant_format="fp8_block")
    loaded = load_model(make_server_args(model_path=str(tmp_path), load_format="dummy"), plan,
                        build_registry())
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.float().std() > 0.01
    assert torch.equal(qkv.weight_scale_inv, torch.ones_like(qkv.weight_scale_inv))
    y = qkv(torch.randn(3, 128))
    assert torch.isfinite(y).all() and y.abs().sum() > 0


def test_moe_quant_agreement_is_by_runner_name_even_when_caps_are_shared(model_spec,
                                                                           clean_plugin_env):
    """Two MoE runners registered with one caps object: the quant method's moe_runners names
    one of them, and only that one fits (the resolver hands each candidate its own name)."""
    from dataclasses import replace

    from plugins_for_tests import builtin_backend_plugins, double_factory

    from core.contract.capabilities import MoECaps, QuantCaps
    from core.contract.hookspecs import hookimpl

    shared = MoECaps(devices={"cuda"}, dtypes={"bfloat16"}, quant_methods={"unquantized"})

    class Vendor:
        @hookimpl
        def core_register_moe_runners(self, register):
            register("vendor_a", shared, double_factory)
            register("vendor_b", shared, double_factory)

        @hookimpl
        def core_register_quant_methods(self, register):
            register("vendor_q", QuantCaps(devices={"cuda"}, config_names={"vendor_q"},
                                           moe=True, moe_runners={"vendor_b"}),
                     double_factory)

    registry = build_registry(extra=builtin_backend_plugins() + [("vendor", Vendor())],
                              entry_points=False)
    spec = replace(model_spec("qwen3-30b-a3b"), quantization={"quant_method": "vendor_q"},
                   quant_method="vendor_q")
    plan = resolve(spec, PROFILES["h200"], ServerArgs(dtype="bfloat16"), registry)
    moe = {c.name: c for c in plan.candidates if c.slot == "moe_runner"}
    assert plan.moe_runner == "vendor_b" and moe["vendor_b"].fits
    assert not moe["vendor_a"].fits
