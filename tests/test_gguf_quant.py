"""GGUF kept quantized (plugins/quant/gguf): the block formats against the `gguf` package's own
dequantization, the C kernels of every ISA variant this CPU runs against a torch model of their
arithmetic, and the default SmolLM2 model served from its Q4_1 / Q8_0 blocks against HF."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from core.contract.capabilities import DeviceInfo
from core.plan.checks import check_device
from core.plan.registry import build_registry
from plugins._kit.cbuild import ISA_FEATURES
from plugins.quant.gguf import formats
from plugins.quant.gguf.formats import random_blocks
from plugins.quant.gguf.kernels import Kernels


def cpu_features() -> set[str]:
    from plugins.hardware.cpu import ISA_FLAGS, read_cpuinfo

    info = read_cpuinfo() or {}
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {f for f in ISA_FLAGS if f in flags}


def runnable_variants() -> list:
    have = cpu_features()
    out = []
    for variant, need in ISA_FEATURES.items():
        if variant == "amx":  # amx.c, not kernels.c: tests/test_gguf_amx.py
            continue
        lacking = sorted(need - have)
        marks = [pytest.mark.skip(reason=f"CPU lacks {', '.join(lacking)}")] if lacking else []
        out.append(pytest.param(variant, marks=marks, id=variant))
    return out


def reference_product(x: torch.Tensor, w: torch.Tensor, bs: int, bits: int) -> torch.Tensor:
    """x @ w.T with x quantized per block of `bs` as the kernels do: to int8 or int16
    (|q| <= 32512) with the block's scale amax / qmax and its reciprocal in fp32, rounded half
    to even (fp64 sums)."""
    qmax = 127 if bits == 8 else 32512  # 127 * 256: int16 codes as two int8 planes
    m, k = x.shape
    xb = x.float().reshape(m, k // bs, bs)
    d = xb.abs().amax(-1, keepdim=True) / qmax
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(xb * inv).clamp(-qmax, qmax)
    return (q.double() * d.double()).reshape(m, k) @ w.double().T


@pytest.mark.parametrize("type_name", formats.SUPPORTED)
def test_blocks_dequantize_exactly_like_the_gguf_package(type_name):
    raw = random_blocks(type_name, 6, 512)
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, 512)
    got = formats.dequantize_ref(formats.from_ggml(type_name, raw, 512))
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def test_unsupported_types_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="Q3_K has no kernel"):
        formats.from_ggml("Q3_K", np.zeros((1, 110), np.uint8), 256)
    with pytest.raises(ValueError, match="do not hold 64 elements"):
        formats.from_ggml("Q4_0", np.zeros((1, 18), np.uint8), 64)


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("type_name", formats.SUPPORTED)
def test_kernel_products_match_their_arithmetic(variant, type_name, act_bits):
    kern = Kernels(variant, act_bits)
    # against the fp32 product: only the activations' rounding apart
    dense_tol = 2e-2 if act_bits == 8 else 1e-4
    # 576 (the default model's width) = 18 blocks of 32: 4-block steps and a remainder of 2;
    # 1,024: whole 16-block rounds
    shapes = [(1, 40, 512), (5, 33, 320), (6, 9, 96), (9, 4, 32), (5, 22, 576), (2, 7, 576),
              (7, 13, 1024), (3, 6, 576)]
    if type_name.endswith("_K"):
        shapes = [(1, 40, 512), (3, 17, 768), (9, 5, 256)]
    gen = torch.Generator().manual_seed(1)
    for m, n, k in shapes:
        p = formats.from_ggml(type_name, random_blocks(type_name, n, k, seed=m), k)
        w = formats.dequantize_ref(p)
        assert torch.equal(kern.dequantize(p, torch.float32), w)
        rows = torch.tensor([[n - 1, 0], [1, n - 1]])
        assert torch.equal(kern.dequantize(p, torch.float32, rows=rows), w[rows])
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        want = reference_product(x, w, p.bs, act_bits) + bias.double()
        got = kern.linear(x, p, bias).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (m, n, k)
        dense = x.double() @ w.double().T + bias.double()
        assert ((got - dense).norm() / dense.norm()).item() < dense_tol
        xb = x.bfloat16()
        got_b = kern.linear(xb, p, out_dtype=torch.float32).double()
        want_b = reference_product(xb.float(), w, p.bs, act_bits)
        assert ((got_b - want_b).norm() / want_b.norm()).item() < 1e-5
        assert kern.linear(xb, p).dtype == torch.bfloat16
        bound = kern.bind(p)
        assert torch.equal(bound(x), kern.linear(x, p))


@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(variant, type_name, act_bits):
    """Every row of an M-row product is bit for bit its 1-row product (the multi-row kernels
    keep each row's arithmetic), so a decode step's tokens do not depend on what they are
    batched with; M 2..13 crosses the tile shapes and their remainders."""
    kern = Kernels(variant, act_bits)
    # 576 (the default model's width): 16-block rounds and a remainder of 2 blocks
    for k in (256, 768) if type_name.endswith("_K") else (96, 576):
        _rows_alone(kern, type_name, k)


def _rows_alone(kern, type_name, k):
    p = formats.from_ggml(type_name, random_blocks(type_name, 21, k, seed=3), k)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(21, generator=gen)
    for m in range(2, 14):
        x = torch.randn(m, k, generator=gen)
        got = kern.linear(x, p, bias)
        for i in range(m):
            assert torch.equal(got[i:i + 1], kern.linear(x[i:i + 1], p, bias)), (m, i)


def test_stacked_shards_of_different_types_are_exact():
    parts = [("Q4_K", 8), ("Q6_K", 4), ("Q8_0", 4), ("Q4_1", 8)]
    packed = [formats.from_ggml(t, random_blocks(t, n, 256, seed=i), 256)
              for i, (t, n) in enumerate(parts)]
    whole = formats.stack(packed)
    assert (whole.bits, whole.bs, whole.scales.dtype) == (8, 16, torch.float32)
    assert torch.equal(formats.dequantize_ref(whole),
                       torch.cat([formats.dequantize_ref(p) for p in packed]))


def test_the_resolver_picks_the_best_variant_and_explains_the_others():
    registry = build_registry()
    avx2_only = DeviceInfo(target="cpu", device_type="cpu", features={"avx2", "fma", "f16c"})
    reasons = {n: check_device(r.caps, avx2_only)
               for n, r in registry.kind("quant").items() if n.startswith("gguf_")}
    assert reasons["gguf_avx2"] == [] and reasons["gguf_c"] == []
    assert any("avx512_vnni" in r for r in reasons["gguf_avx512"])


@pytest.fixture(scope="module")
def smollm_pair():
    """The default model loaded from its blocks (the best variant here) and dequantized, with
    HF's own model of the same file."""
    from hf_reference import hf_gguf_model
    from model_fixtures import cpu_plan

    from core.engine.loader import default_model_path, load_model
    from core.engine.worker import make_plan
    from core.plan.args import make_server_args

    registry = build_registry()
    args = make_server_args(model_path=default_model_path(), dtype="float32")
    best = make_plan(args, registry)[1].quant_method
    quantized = load_model(args, dataclasses.replace(cpu_plan("llama"), quant_method=best),
                           registry)
    return best, quantized, hf_gguf_model(default_model_path())


def test_default_model_served_from_its_blocks_against_hf(smollm_pair):
    from model_fixtures import prefill_logits

    best, quantized, hf = smollm_pair
    assert best.startswith("gguf_")
    model = quantized.model
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.packed is not None and layer.packed.types == ("Q4_1",)
    assert layer.weight.numel() == 0  # no dense copy of the weight is kept
    assert model.model.embed_tokens.table is not None  # Q8_0 embedding and tied LM head
    tok = quantized.tokenizer
    text = ("The water cycle moves water between the oceans, the air and the land. The sun "
            "heats the sea, water evaporates, the vapour cools into clouds and falls as rain or "
            "snow, and rivers carry it back to the sea, where the cycle starts again. ") * 2
    ids = tok.encode(text)
    assert len(ids) > 64  # the prefill path (dequantized weights) and, below, the kernels'
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for part in (ids, ids[:40]):
        ours = prefill_logits(model, quantized.hf_config, part)
        want = ref[:len(part)]
        agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
        cos = torch.nn.functional.cosine_similarity(ours, want, dim=-1).min().item()
        # int16 activations per block of 32 against HF's fp32 ones
        assert agree >= 0.97 and cos > 0.9999, (len(part), agree, cos)


def test_the_default_engine_serves_the_blocks_and_answers():
    import core

    with core.Engine(max_total_tokens=2048) as engine:
        plan = engine.plan
        assert plan.quant_method.startswith("gguf_") and plan.quant_format == "gguf"
        assert plan.layer_ops.startswith("cpu_c") and plan.decode_attention.startswith("cpu_c")
        notes = engine.info.notes
        assert any("GGUF blocks kept" in n and "120 Q4_1, 1 Q8_0 table" in n for n in notes)
        assert any("no dense weights to pack" in n for n in notes), notes
        tok = engine.tokenizer
        ids = tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]),
            add_special_tokens=False)
        out = engine.generate(input_ids=[ids, ids], sampling_params={
            "max_new_tokens": 24, "temperature": 0})
        assert "Paris" in out[0]["text"]  # (int8 activations, llama.cpp's, lose this answer)
        assert out[0]["output_ids"] == out[1]["output_ids"]  # batch-invariant greedy


def test_the_header_tensor_table_reads_what_gguf_reader_reads():
    import gguf

    from core.engine.gguf_weights import _tensor_table
    from core.engine.loader import default_model_path

    path = default_model_path()
    arch, fast = _tensor_table(path)
    slow = gguf.GGUFReader(path).tensors
    assert arch == "llama" and [t.name for t in fast] == [t.name for t in slow]
    for a, b in zip(fast, slow, strict=True):
        assert a.tensor_type == b.tensor_type and tuple(a.shape) == tuple(int(d) for d in b.shape)
        assert np.array_equal(np.asarray(a.data).reshape(-1).view(np.uint8),
                              np.asarray(b.data).reshape(-1).view(np.uint8))


def test_the_gguf_conversion_cache_gives_the_same_config_and_tokenizer(tmp_path, monkeypatch):
    import os

    from core.engine.loader import default_model_path, find_weights, load_config
    from core.tokenizer import Tokenizer

    monkeypatch.setenv("CORE_GGUF_CACHE", str(tmp_path))
    source = find_weights(default_model_path(), "auto")
    first = load_config(source)  # converted, then saved
    assert any((p / "config" / "config.json").is_file() for p in tmp_path.iterdir())
    again = load_config(source)  # read back
    assert again.to_dict() == first.to_dict()
    cold = Tokenizer.from_path(source.directory, gguf_file=source.gguf_file)
    warm = Tokenizer.from_path(source.directory, gguf_file=source.gguf_file)
    text = "Hello, world! Ünïcödé and <|im_start|> tokens\n\tindented"
    assert warm.encode(text) == cold.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert warm.apply_chat_template(chat) == cold.apply_chat_template(chat)
    assert warm.eos_token_ids == cold.eos_token_ids
    monkeypatch.setenv("CORE_GGUF_CACHE", "off")
    assert os.environ["CORE_GGUF_CACHE"] == "off" and load_config(source).to_dict() == \
        first.to_dict()


def test_host_kv_buffers_are_zero_in_every_dtype():
    from core.contract.platform import platform_for_device

    cpu = torch.device("cpu")
    zeros = platform_for_device(cpu).zeros  # the cpu platform's (calloc) since the KV pool's
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        z = zeros((4, 3, 8), dt, cpu)
        assert z.dtype == dt and z.shape == (4, 3, 8) and not z.float().any()
