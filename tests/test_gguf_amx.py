"""gguf_amx (issue 38): the AMX bf16 tile kernel (plugins/quant/gguf/amx.c) against an fp32
product of the same weights rounded to bf16, and the resolver's choice of it. The kernel tests
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
def test_the_method_sends_32_rows_and_more_to_the_tiles():
    from plugins.quant.gguf import method
    from plugins.quant.gguf.kernels import AmxKernels, Kernels

    p = packed("Q4_1", 64, 128)
    vnni, amx = Kernels("avx512_vnni"), AmxKernels()
    run = method.product(vnni, p, amx=amx)
    x = torch.randn(method.AMX_MIN_ROWS, 128).bfloat16()
    assert torch.equal(run(x), amx.bind(p)(x))
    small = x[: method.AMX_MIN_ROWS - 1]
    assert torch.equal(run(small), vnni.bind(p)(small))
    xf = x.float()  # fp32 inputs never take the tiles
    assert torch.equal(run(xf), vnni.bind(p)(xf))


def test_the_resolver_picks_gguf_amx_for_bf16_on_amx_and_explains_elsewhere():
    registry = build_registry()
    caps = registry.kind("quant")["gguf_amx"].caps
    amx_cpu = DeviceInfo(target="cpu", device_type="cpu",
                         features=set(ISA_FEATURES["amx"]) | {"bf16"})
    vnni_cpu = DeviceInfo(target="cpu", device_type="cpu",
                          features=set(ISA_FEATURES["avx512_vnni"]))
    assert check_device(caps, amx_cpu) == []
    assert any("amx_tile" in r for r in check_device(caps, vnni_cpu))
    assert caps.dtypes == frozenset({"bfloat16"})  # under fp32 it would not use the tiles
    prio = {n: r.caps.priority.get("cpu", 0) for n, r in registry.kind("quant").items()
            if n.startswith("gguf_")}
    assert max(prio, key=prio.get) == "gguf_amx"


def test_the_default_model_plans_gguf_amx_on_a_simulated_amx_xeon():
    """core resolve on the xeon-amx profile: bf16 takes the tiles, --dtype auto (fp32 on the
    CPU) keeps gguf_avx512 and says why gguf_amx does not fit, and notes the tiles."""
    from core.engine.loader import default_model_path
    from core.engine.worker import make_plan
    from core.plan.args import make_server_args

    def plan(dtype: str):
        args = make_server_args(model_path=default_model_path(), dtype=dtype,
                                device_profile="xeon-amx")
        return make_plan(args)[1]

    bf16 = plan("bfloat16")
    assert bf16.quant_method == "gguf_amx"
    auto = plan("auto")
    assert auto.quant_method == "gguf_avx512"
    amx = [c for c in auto.candidates if c.slot == "quant_method" and c.name == "gguf_amx"]
    assert amx and "compute dtype float32 not supported" in " ".join(amx[0].reasons)
    assert any("AMX bf16 tiles" in n for n in auto.notes)
