"""The mxfp4 quant method: its decoder against the independent one written from the OCP MX spec
(conformance/quant_refs_mxfp4.py) on every code and every scale byte, round trips through the
test-side quantizer, refused shapes, GPT-OSS's tensors loaded from HF's names and shapes (kept
packed), and both MoE runners (torch_native; triton's dequantizing kernels under the
interpreter, fp32 and fp16) against the fp32 reference with the experts' biases. The suite's
own mxfp4 cases run in tests/test_quant.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the triton runner's kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from conformance.quant_refs_mxfp4 import build_expert, decode_blocks, quantize  # noqa: E402
from core.contract.quant import parse_quant_config  # noqa: E402
from core.layers import ModelContext, MoE  # noqa: E402
from core.layers.linear import process_weights_after_loading  # noqa: E402
from plugins._kit import mxfp4  # noqa: E402
from plugins.moe.triton import kernels as moe_kernels  # noqa: E402
from plugins.quant.mxfp4.method import Mxfp4Method  # noqa: E402

GPT_OSS = {"quant_method": "mxfp4",
           "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                      "model.embed_tokens", "lm_head"]}


def _method(config=GPT_OSS) -> Mxfp4Method:
    return Mxfp4Method(parse_quant_config(config))


def test_every_code_at_every_scale_decodes_as_the_spec_says():
    # row s: the 256 byte values (every pair of codes) under scale byte s, for s in 0..255
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 16, 16), (256, 1, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    with np.errstate(over="ignore"):  # 6 x 2^127 is past fp32: inf, in both decoders
        want = decode_blocks(blocks, scales).astype(np.float32)
    packed, s = mxfp4.from_hf_blocks(torch.from_numpy(blocks), torch.from_numpy(scales))
    got = mxfp4.dequantize(packed, s).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[255]).all() and not np.isnan(got[:255]).any()  # 0xFF is NaN
    finite = ~np.isnan(want)
    # bit for bit: negative zero (code 8) keeps its sign, 2^-127 (scale 0) is a subnormal
    assert np.array_equal(got.view(np.int32)[finite], want.view(np.int32)[finite])
    assert got[127, 0] == 0.0 and np.signbit(got[127, 8 * 2])  # byte 8: low nibble -0
    assert got[0, 2] == np.float32(2.0 ** -128)  # byte 1: low nibble 0.5, times 2^-127
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(mxfp4.dequantize(packed[100:140], s[100:140], dtype),
                           torch.from_numpy(got[100:140]).to(dtype))


def test_round_trip_through_the_test_quantizer():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=gen) * torch.logspace(-3, 1, 16)[:, None]
    w[3, :32] = 0.0  # an all-zero block: scale byte 0, codes 0
    w[4, :32] = -1e-30  # tiny negatives beside a 1.0 (scale 2^-2): negative zeros
    w[4, 0] = 1.0
    blocks, scales = quantize(w.numpy())
    packed, s = mxfp4.from_hf_blocks(torch.from_numpy(blocks), torch.from_numpy(scales))
    ours = mxfp4.dequantize(packed, s)
    spec = torch.from_numpy(decode_blocks(blocks, scales)).float()
    assert torch.equal(ours, spec)
    assert scales[3, 0] == 0 and (blocks[3, 0] == 0).all() and blocks[4, 0, 0] == 0x86 \
        and (blocks[4, 0, 1:] == 0x88).all() and torch.signbit(ours[4, 1:32]).all()
    # nearest e2m1 at the block's scale u = 2^(floor(log2 amax) - 2): within half the widest
    # gap (4u -> 6u) below 6u, and what saturates at 6u is below amax < 8u; so off by less
    # than 2u, and by at most a quarter of the block's largest magnitude
    unit = torch.from_numpy(2.0 ** (scales.astype(np.float64) - 127)).float()
    err = (ours - w).abs().reshape(16, 4, 32)
    assert (err <= 2 * unit[..., None]).all()
    amax = w.abs().reshape(16, 4, 32).amax(-1, keepdim=True)
    assert (err <= amax / 4 + 1e-30).all()


def test_odd_shapes_and_types_are_refused():
    b = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scales \(2, 4, 2\) do not match blocks"):
        mxfp4.from_hf_blocks(b, torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"not \[\.\.\., N, K/32, 16\]"):
        mxfp4.from_hf_blocks(torch.zeros(2, 4, 3, 8, dtype=torch.uint8),
                             torch.zeros(2, 4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.from_hf_blocks(b.float(), torch.zeros(2, 4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        mxfp4.dequantize(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match packed values"):
        mxfp4.dequantize(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
    ctx = _ctx(torch.float32, _runner("torch_native"))
    with pytest.raises(ValueError, match=r"hidden size \(48.*multiple of 32"):
        MoE(4, 2, 48, 64, ctx)
    with pytest.raises(ValueError, match=r"intermediate size \(40.*multiple of 32"):
        MoE(4, 2, 64, 40, ctx)
    with pytest.raises(ValueError, match="leaves some MoE experts dense"):
        _method({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.3.mlp.experts"]})
    with pytest.raises(ValueError, match="mxfp4 cannot compute fp8_block"):
        Mxfp4Method(parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128]}))


def _runner(name: str, **options):
    from core.plan.registry import get_registry

    return get_registry().get("moe", name).load()(**options)


def _ctx(dtype: torch.dtype, runner) -> ModelContext:
    return ModelContext(dtype=dtype, device=torch.device("cpu"), quant_method=_method(),
                        moe_runner=runner)


class GptOssExperts:
    """One GPT-OSS MoE layer's expert tensors under HF's names and shapes (gate/up rows
    interleaved), quantized by the test-side quantizer, and what they mean in fp32."""

    def __init__(self, experts: int, hidden: int, inter: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3  # interleaved rows
        w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
        self.hf, self.w13, self.w2 = {}, [], []
        for name, w, out in (("gate_up_proj", w13, self.w13), ("down_proj", w2, self.w2)):
            parts = [build_expert(w[e], edges=e == 0) for e in range(experts)]
            self.hf[f"{name}_blocks"] = torch.stack([t["blocks"] for t, _ in parts])
            self.hf[f"{name}_scales"] = torch.stack([t["scales"] for t, _ in parts])
            out.extend(d for _, d in parts)
        self.hf["gate_up_proj_bias"] = (torch.randn(experts, 2 * inter, generator=gen)
                                        * 0.1).bfloat16()
        self.hf["down_proj_bias"] = (torch.randn(experts, hidden, generator=gen) * 0.1).bfloat16()
        self.router = torch.randn(experts, hidden, generator=gen) * 0.3

    def load(self, moe: MoE) -> None:
        """What the GPT-OSS model does with each `mlp.experts.*` tensor."""
        for leaf, tensor in self.hf.items():
            name, ours = mxfp4.gpt_oss_expert_tensor(leaf, tensor)
            moe.weight_loader(getattr(moe, name), ours)
        moe.gate.weight.data.copy_(self.router.to(moe.gate.weight.dtype))
        process_weights_after_loading(moe)

    def reference(self, x: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
        """fp32: routing, then per expert x @ W13^T + b13 in HF's interleaved order (gate even
        rows, up odd), SiLU(gate) * up rounded to `dtype`, @ W2^T + b2, weighted."""
        b13, b2 = self.hf["gate_up_proj_bias"].float(), self.hf["down_proj_bias"].float()
        scores = torch.softmax(x.float() @ self.router.to(dtype).float().t(), -1)
        top_w, top_i = scores.topk(top_k, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], self.w2[0].shape[0])
        for t in range(x.shape[0]):
            for wt, e in zip(top_w[t].tolist(), top_i[t].tolist(), strict=True):
                gu = x[t].float() @ self.w13[e].t() + b13[e]
                h = (torch.nn.functional.silu(gu[0::2]) * gu[1::2]).to(dtype).float()
                out[t] += wt * (h @ self.w2[e].t() + b2[e])
        return out


def test_gpt_oss_tensors_load_packed_with_the_checkpoints_bytes():
    ref = GptOssExperts(experts=4, hidden=64, inter=32, seed=1)
    moe = MoE(4, 2, 64, 32, _ctx(torch.bfloat16, _runner("torch_native")))
    ref.load(moe)
    w = moe.weights()
    assert w.form == "mxfp4" and w.w13.dtype == w.w2.dtype == torch.uint8
    assert w.w13.numel() == ref.hf["gate_up_proj_blocks"].numel()  # as many bytes as the file
    assert w.w2.numel() == ref.hf["down_proj_blocks"].numel()
    assert not any(p.dtype.is_floating_point and p.dim() == 3 for p in moe.parameters())
    # our rows: gate rows then up rows, each the HF row it came from
    for e in range(4):
        ours = mxfp4.dequantize(w.w13[e], w.extra["w13_scale"][e])
        assert torch.equal(ours[:32], ref.w13[e][0::2]) and torch.equal(ours[32:],
                                                                        ref.w13[e][1::2])
        assert torch.equal(mxfp4.dequantize(w.w2[e], w.extra["w2_scale"][e]), ref.w2[e])
        assert torch.equal(w.extra["w13_bias"][e][:32],
                           ref.hf["gate_up_proj_bias"][e, 0::2].float())
    with pytest.raises(KeyError, match="not an mxfp4 expert tensor"):
        mxfp4.gpt_oss_expert_tensor("gate_up_proj", ref.hf["gate_up_proj_bias"])
    assert "kept packed" in moe.expert_quant_method.load_summary()


# triton under the interpreter: its bf16 tl.dot cannot be trusted there, its tl.dot_scaled can
@pytest.mark.parametrize("runner,dot,dtype,tol", [
    ("torch_native", None, torch.float32, 1e-5), ("torch_native", None, torch.bfloat16, 1.2e-2),
    ("triton", "auto", torch.float32, 1e-5), ("triton", "decode", torch.float16, 5e-3),
    ("triton", "scaled", torch.float16, 5e-3), ("triton", "auto", torch.bfloat16, 1.2e-2)])
def test_runners_match_the_reference(runner, dot, dtype, tol):
    if runner == "triton" and os.environ.get("TRITON_INTERPRET", "") in ("", "0") \
            and not torch.cuda.is_available():
        pytest.skip("the triton runner needs TRITON_INTERPRET=1 on the CPU")
    ref = GptOssExperts(experts=4, hidden=64, inter=64, seed=2)
    moe = MoE(4, 2, 64, 64, _ctx(dtype, _runner(runner, **({"mxfp4_dot": dot} if dot else {}))))
    ref.load(moe)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 5, 33):  # a decode step (fused sum), a few rows, several row blocks
        x = torch.randn(m, 64, generator=gen).to(dtype)
        with torch.no_grad():
            y = moe(x)
        want = ref.reference(x, 2, dtype)
        err = ((y.float() - want).norm() / want.norm()).item()
        assert y.dtype == dtype and err < tol, (m, err)


@pytest.mark.parametrize("dot,dtype,tol", [("auto", torch.float32, 1e-5),
                                            ("decode", torch.float16, 5e-3),
                                            ("scaled", torch.float16, 5e-3)])
def test_triton_runs_gpt_oss_mxfp4_experts_with_swigluoai(dot, dtype, tol):
    """GPT-OSS's own expert math on its packed experts: the clamped SwiGLU (limit 0.75: most
    gate and up values clamped) and both biases, triton against torch_native on the same
    weights and layer, at decode and prefill sizes."""
    import dataclasses

    from core.contract.moe import MoELayerParams

    if os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("the triton runner needs TRITON_INTERPRET=1 on the CPU")
    ref = GptOssExperts(experts=4, hidden=64, inter=64, seed=6)
    moe = MoE(4, 2, 64, 64, _ctx(dtype, _runner("torch_native")))
    ref.load(moe)
    weights = moe.weights()
    assert weights.form == "mxfp4" and "w13_bias" in weights.extra
    layer = MoELayerParams(0, 4, 2, 64, 64, activation="swigluoai", swiglu_limit=0.75)
    silu = dataclasses.replace(layer, activation="silu")
    triton_runner = _runner("triton", mxfp4_dot=dot)
    native = _runner("torch_native")
    gen = torch.Generator().manual_seed(7)
    for m in (1, 5, 33):
        x = torch.randn(m, 64, generator=gen).to(dtype)
        logits = torch.randn(m, 4, generator=gen)
        want = native.forward(x, logits, weights, layer).float()
        got = triton_runner.forward(x, logits, weights, layer)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert got.dtype == dtype and err < tol, (m, err)
        other = native.forward(x, logits, weights, silu).float()  # the activation matters here
        assert ((other - want).norm() / want.norm()).item() > 10 * tol


def test_gpt_oss_20b_plans_mxfp4_where_it_runs(model_spec, clean_plugin_env):
    """With the installed plugins GPT-OSS-20B plans on the H200 with its experts kept in mxfp4
    on the triton MoE runner (GPT-OSS's clamped SwiGLU, `swigluoai`, and the expert biases in
    its kernels; torch_native fits too, at a lower priority); below sm80 mxfp4 is refused with
    its reason."""
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.plan import ResolveError
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve

    registry = build_registry()
    spec = model_spec("gpt-oss-20b")
    plan = resolve(spec, PROFILES["h200"], ServerArgs(), registry)
    assert (plan.quant_method, plan.moe_runner, plan.model_impl) == ("mxfp4", "triton",
                                                                     "gpt_oss")
    native = [c for c in plan.candidates if c.slot == "moe_runner" and c.name == "torch_native"]
    assert native and native[0].fits and not native[0].chosen
    with pytest.raises(ResolveError) as t4:
        resolve(spec, PROFILES["t4"], ServerArgs(), registry)
    assert "mxfp4: needs CUDA sm80+ (device is sm75)" in str(t4.value)


def test_a_model_loads_gpt_oss_names_through_the_strict_loader():
    """What plugins/models/gpt_oss.py does: each `...mlp.experts.<leaf>` tensor through
    plugins._kit.mxfp4.gpt_oss_expert_tensor to `...mlp.<param>`, the rest by name; the
    strict loader then finds nothing missing or unexpected, and the layer runs."""
    import re

    from torch import nn

    from plugins.models.weights import load_named_weights

    ref = GptOssExperts(experts=4, hidden=64, inter=32, seed=4)

    def fresh() -> nn.Module:
        layer = nn.Module()
        layer.mlp = MoE(4, 2, 64, 32, _ctx(torch.float32, _runner("torch_native")))
        model = nn.Module()
        model.layers = nn.ModuleList([layer])
        return model

    model = fresh()
    hf = {f"layers.0.mlp.experts.{leaf}": t for leaf, t in ref.hf.items()}
    hf["layers.0.mlp.router.weight"] = ref.router

    def renamed():
        for name, tensor in hf.items():
            m = re.fullmatch(r"(.*\.mlp)\.experts\.(\w+)", name)
            if m:
                ours, tensor = mxfp4.gpt_oss_expert_tensor(m.group(2), tensor)
                yield f"{m.group(1)}.{ours}", tensor
            else:
                yield name.replace(".router.", ".gate."), tensor

    load_named_weights(model, renamed())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = model.layers[0].mlp(x)
    want = ref.reference(x, 2, torch.float32)
    assert ((y - want).norm() / want.norm()).item() < 1e-5
    del hf["layers.0.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match=r"missing tensors: layers\.0\.mlp\.w2_scales"):
        load_named_weights(fresh(), renamed())


def _random_layer_check(e: int, h: int, i: int, tokens: int, device: str,
                       dtype: torch.dtype, tol: float, dot: str = "auto") -> None:
    """Random HF GPT-OSS expert tensors (every code, scales 2^-9..2^-4) through the triton
    runner against each routed expert dequantized here, fp32 products, biases added."""
    gen = torch.Generator().manual_seed(6)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    def exps(*shape):
        return torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8)

    hf = {"gate_up_proj_blocks": codes(e, 2 * i, h // 32, 16),
          "gate_up_proj_scales": exps(e, 2 * i, h // 32),
          "gate_up_proj_bias": (torch.randn(e, 2 * i, generator=gen) * 0.1).bfloat16(),
          "down_proj_blocks": codes(e, h, i // 32, 16), "down_proj_scales": exps(e, h, i // 32),
          "down_proj_bias": (torch.randn(e, h, generator=gen) * 0.1).bfloat16()}
    ctx = ModelContext(dtype=dtype, device=torch.device(device), quant_method=_method(),
                       moe_runner=_runner("triton", mxfp4_dot=dot))
    moe = MoE(e, 4, h, i, ctx)
    for leaf, t in hf.items():
        name, ours = mxfp4.gpt_oss_expert_tensor(leaf, t)
        moe.weight_loader(getattr(moe, name), ours.to(device))
    moe.gate.weight.data.copy_((torch.randn(e, h, generator=gen) * 0.05).to(dtype))
    process_weights_after_loading(moe)
    w = moe.weights()
    x = torch.randn(tokens, h, generator=gen).to(dtype).to(device)
    with torch.no_grad():
        y = moe(x).float()
        route_w, ids = torch.softmax(moe.gate(x).float(), -1).topk(4, -1)
        route_w = route_w / route_w.sum(-1, keepdim=True)
        want = torch.zeros_like(y)
        for t in range(tokens):
            for wt, ex in zip(route_w[t].tolist(), ids[t].tolist(), strict=True):
                w13 = mxfp4.dequantize(w.w13[ex], w.extra["w13_scale"][ex])
                gu = x[t].float() @ w13.t() + w.extra["w13_bias"][ex]
                hid = (torch.nn.functional.silu(gu[:i]) * gu[i:]).to(dtype).float()
                w2 = mxfp4.dequantize(w.w2[ex], w.extra["w2_scale"][ex])
                want[t] += wt * (hid @ w2.t() + w.extra["w2_bias"][ex])
    err = ((y - want).norm() / want.norm()).item()
    assert err < tol, (tokens, err)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr):
    """Store the [K, N] tile the MoE kernels' decoder (kernels._mxfp4_tile) makes."""
    offs_k = tl.arange(0, K)
    offs_n = tl.arange(0, N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    tile = moe_kernels._mxfp4_tile(w_ptr, s_ptr, offs_k, offs_n, mask, K // 2, K // 32, 1,
                                   tl.float32)
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], tile)


# 6 x 2^127 is past fp32: inf, as in the spec decoder (the interpreter's numpy says so)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_triton_tile_decoder_on_every_code_and_scale():
    """The kernels' in-register decoder (kernels._mxfp4_tile) against the spec decoder, bit
    for bit: row n holds every byte value under scale byte n, for n in 0..255 (NaN at 0xFF,
    negative zeros, 2^-127)."""
    if os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 16, 16), (256, 1, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    packed, s = mxfp4.from_hf_blocks(torch.from_numpy(blocks), torch.from_numpy(scales))
    out = torch.empty(512, 256, dtype=torch.float32, device=device)
    _decode_kernel[(1,)](packed.to(device).contiguous(), s.to(device).contiguous(), out, K=512, N=256)
    got = out.t().cpu().numpy()
    with np.errstate(over="ignore"):
        want = decode_blocks(blocks, scales).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[255]).all()
    finite = ~np.isnan(want)
    assert np.array_equal(got.view(np.int32)[finite], want.view(np.int32)[finite])


@pytest.mark.parametrize("dot", ["decode", "scaled"])
def test_triton_on_random_codes_interpreted(dot):
    """The GPU check below at a tiny size under the interpreter (fp16: its bf16 dots are not
    to be trusted), 96 = 3 blocks of 32 that no tile divides."""
    if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        pytest.skip("the triton runner needs TRITON_INTERPRET=1 on the CPU")
    _random_layer_check(8, 96, 64, 6, "cpu", torch.float16, 5e-3, dot)


def test_triton_scaled_dot_refuses_fp32():
    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), quant_method=_method(),
                       moe_runner=_runner("triton", mxfp4_dot="scaled"))
    ref = GptOssExperts(experts=4, hidden=64, inter=32, seed=7)
    moe = MoE(4, 2, 64, 32, ctx)
    ref.load(moe)
    with pytest.raises(ValueError, match="multiplies bf16 / fp16 activations, not torch.float32"):
        moe(torch.randn(2, 64))
    with pytest.raises(ValueError, match="mxfp4_dot must be one of"):
        _runner("triton", mxfp4_dot="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("dot", ["scaled", "decode"])
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_triton_bf16_at_gpt_oss_20b_sizes(tokens, dot):
    """One GPT-OSS-20B MoE layer's shapes (32 experts, top-4, hidden = intermediate = 2880,
    not a multiple of the tiles) in bf16 on the GPU, both products, against the fp32
    reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _random_layer_check(32, 2880, 2880, tokens, "cuda", torch.bfloat16, 1.2e-2, dot)


def test_moe_decode_counts_mxfp4_experts_at_their_packed_size():
    """bench/moe_decode.py's active bytes for GPT-OSS-20B: the bf16 count of the same config
    less what packing saves on the top-k experts (2 bytes -> 17/32 of a byte a weight)."""
    import json
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "bench"))
    from moe_decode import active_bytes_per_token

    cfg = json.loads((repo / "tests/fixtures/configs/gpt-oss-20b.json").read_text())
    dense = {k: v for k, v in cfg.items() if k != "quantization_config"}
    routed = cfg["num_hidden_layers"] * cfg["experts_per_token"] * 3 * cfg["hidden_size"] \
        * cfg["intermediate_size"]
    assert active_bytes_per_token(cfg) == pytest.approx(
        active_bytes_per_token(dense) - routed * (2 - 17 / 32), rel=1e-9)
