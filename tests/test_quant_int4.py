"""INT4 weight-only quant methods (`awq`, `gptq`: plugins/quant/int4) against an independent
reference packer (conformance.quant_refs_int4, written from the formats' descriptions).

- the packer itself: nibble order of each format on hand-made words, and compressed-tensors'
  own `pack_to_int32` where the package is installed;
- a stacked Linear(K, [40, 16, 24]) loaded shard by shard by the checkpoint's names, apply()
  against x @ dequantized^T in fp32 at M = 1, 4, 33, 300: the CPU path (dequantize per call)
  and the Triton kernel (interpreter on a CPU, fp16 and fp32);
- refusals: non-trivial g_idx, wrong weight_shape; dummy weights process cleanly;
- a tiny Llama quantized into a safetensors checkpoint with its quantization_config, loaded by
  core's loader, logits against transformers fp32 on the dequantized weights;
- the resolver: awq / gptq / compressed-tensors W4A16 on an h200, refused on a t4 (sm75).

Tolerances (outputs compared with torch.testing.assert_close, atol scaled by the reference's
largest magnitude): fp32 paths rtol 1e-5 / atol 1e-5 * max (same numbers, another summation
order); fp16 kernel rtol 2e-3 / atol 2e-3 * max (fp16 operands are exact, the output rounds to
fp16); bf16 (GPU only) 1e-2, the CPU path in bf16 2e-2 (weights rounded to bf16); model logits rtol 1e-4 / atol 1e-4 * max, as tests/test_models.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.quant_refs_int4 import (  # noqa: E402
    awq_tensors,
    gptq_tensors,
    pack_quantized_tensors,
    quantization_config,
)
from core.contract.quant import parse_quant_config  # noqa: E402
from core.layers import Linear  # noqa: E402
from plugins.quant.int4.method import Int4LinearMethod  # noqa: E402

TRITON_OK = (importlib.util.find_spec("triton") is not None
             and (torch.cuda.is_available()
                  or os.environ.get("TRITON_INTERPRET", "") not in ("", "0")))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 256
SHARDS = {"q": 40, "k": 16, "v": 24}  # N = 80: not a multiple of the kernel's 64-wide tiles
ROWS = (1, 4, 33, 300)

# (id, quantization_config, tensors(weight [N, K]) -> (checkpoint tensors, dequantized))
CASES = [
    ("awq-g128", quantization_config("awq", 128), lambda w: awq_tensors(w, 128)),
    ("awq-g64", quantization_config("awq", 64), lambda w: awq_tensors(w, 64)),
    ("awq-g32", quantization_config("awq", 32), lambda w: awq_tensors(w, 32)),
    ("gptq-g128", quantization_config("gptq", 128), lambda w: gptq_tensors(w, 128)),
    ("gptq-g32-sym", quantization_config("gptq", 32, sym=True),
     lambda w: gptq_tensors(w, 32, sym=True)),
    ("gptq_v2-g64", quantization_config("gptq", 64, checkpoint_format="gptq_v2"),
     lambda w: gptq_tensors(w, 64, checkpoint_format="gptq_v2")),
    ("gptq-channel", quantization_config("gptq", -1), lambda w: gptq_tensors(w, -1)),
    ("pack-g128-sym", quantization_config("compressed-tensors", 128),
     lambda w: pack_quantized_tensors(w, 128)),
    ("pack-g64-asym", quantization_config("compressed-tensors", 64, symmetric=False),
     lambda w: pack_quantized_tensors(w, 64, symmetric=False)),
]


def tol(ref: torch.Tensor, rel: float) -> dict:
    return dict(rtol=rel, atol=rel * ref.abs().max().item())


# ---- the reference packer, against the formats' descriptions ----

def test_packer_nibble_orders_on_hand_made_words():
    """Outputs 0..7 of row 0 hold values 0..7: AWQ's word reads 0x75316420 (nibbles hold
    outputs 0,2,4,6,1,3,5,7); GPTQ's qweight word over inputs 0..7 reads 0x76543210."""
    from conformance.quant_refs_int4 import AWQ_ORDER, _pack_last

    values = torch.arange(8).reshape(1, 8)
    assert _pack_last(values, AWQ_ORDER).item() == 0x75316420
    assert _pack_last(values).item() == 0x76543210
    top = _pack_last(torch.full((1, 8), 15))  # all ones: the int32 wraps to -1
    assert top.dtype == torch.int32 and top.item() == -1


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_packer_shapes_and_error(case):
    _, config, make = case
    w = torch.randn(48, K, generator=torch.Generator().manual_seed(0))
    tensors, deq = make(w)
    scheme = parse_quant_config(config)
    g = scheme.group_size or K
    shapes = {"int4_awq": {"qweight": (K, 6), "qzeros": (K // g, 6), "scales": (K // g, 48)},
              "int4_gptq": {"qweight": (K // 8, 48), "qzeros": (K // g, 6),
                            "scales": (K // g, 48), "g_idx": (K,)},
              "int4_pack": {"weight_packed": (48, K // 8), "weight_scale": (48, K // g),
                            "weight_shape": (2,)}}[scheme.format]
    if scheme.format == "int4_pack" and scheme.zero_point:
        shapes["weight_zero_point"] = (6, K // g)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    # min-max rounding: every weight within one step (its group's scale) of the original
    scales = tensors["scales"] if "scales" in tensors else tensors["weight_scale"].t()
    step = scales.float().t().repeat_interleave(g, 1)
    assert ((deq - w).abs() <= step * 1.01).all()


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="compressed-tensors is not installed")
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_matches_compressed_tensors(symmetric):
    """compressed-tensors' own packer gives the same words from the same signed values."""
    try:  # compressed-tensors >= 0.13 moved it
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
            pack_to_int32,
        )

    from conformance.quant_refs_int4 import quantize_groups

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    tensors, _ = pack_quantized_tensors(w, 64, symmetric=symmetric)
    q, _, zeros = quantize_groups(w, 64, symmetric=symmetric)
    assert torch.equal(tensors["weight_packed"], pack_to_int32((q - 8).to(torch.int8), 4))
    if not symmetric:
        assert torch.equal(tensors["weight_zero_point"],
                           pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0))


# ---- a stacked Linear loaded by name, shard by shard ----

def build_linear(config: dict, dtype: torch.dtype, bias: bool, device: str = "cpu"):
    scheme = parse_quant_config(config)
    ctx = SimpleNamespace(dtype=dtype, device=torch.device(device),
                          quant_method=Int4LinearMethod(scheme))
    return Linear(K, list(SHARDS.values()), bias, ctx, shard_names=list(SHARDS))


def loaded_linear(case, dtype: torch.dtype, bias: bool = False, device: str = "cpu"):
    """(layer after loading and processing, dequantized fp32 [N, K], bias fp32 or None)."""
    _, config, make = case
    layer = build_linear(config, dtype, bias, device)
    gen = torch.Generator().manual_seed(7)
    deq, biases = [], []
    with torch.no_grad():
        for shard, n in SHARDS.items():
            tensors, d = make(torch.randn(n, K, generator=gen))
            if bias:
                tensors["bias"] = torch.randn(n, generator=gen).to(dtype)
                biases.append(tensors["bias"].float())
            for name, tensor in tensors.items():
                layer.weight_loader(getattr(layer, name), tensor.to(device), shard)
            deq.append(d)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat(deq), (torch.cat(biases) if bias else None)


def reference(x: torch.Tensor, deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float().cpu() @ deq.t()
    return y + bias if bias is not None else y


def test_checkpoint_tensors_are_dropped_after_loading():
    layer, _, _ = loaded_linear(CASES[0], torch.float32, device=DEVICE)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"w_q", "w_scales", "w_zeros"}
    assert layer.w_q.shape == (K // 8, sum(SHARDS.values())) and layer.w_q.dtype == torch.int32
    assert layer.w_scales.dtype == torch.float16  # AWQ's fp16 scales, kept exactly
    assert layer.int4_kernel == ("triton" if DEVICE == "cuda" else "dequant")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_path_matches_dequantized_matmul(case):
    """The dequantize-per-call path in fp32, at decode and prefill row counts."""
    layer, deq, bias = loaded_linear(case, torch.float32, bias=case[0].startswith("awq-g128"))
    layer.int4_kernel = "dequant"
    for m in ROWS:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        ref = reference(x, deq, bias)
        torch.testing.assert_close(layer(x), ref, **tol(ref, 1e-5))


def test_cpu_path_in_bf16_and_with_leading_dims():
    layer, deq, _ = loaded_linear(CASES[3], torch.bfloat16)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(3))
    y = layer(x.bfloat16())
    assert y.shape == (2, 3, sum(SHARDS.values())) and y.dtype == torch.bfloat16
    ref = reference(x.bfloat16().reshape(6, K), deq, None).reshape(2, 3, -1)
    torch.testing.assert_close(y.float(), ref, **tol(ref, 2e-2))  # bf16 weights and output


# bf16 on a GPU only: the interpreter's bf16 tl.dot is wrong
KERNEL_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4], CASES[5], CASES[6], CASES[8]],
                         ids=lambda c: c[0])
def test_triton_kernel_matches_dequantized_matmul(case, dtype):
    """The Triton dequant-GEMM (interpreter on a CPU): narrow split-K tiles at M <= 16, the
    larger ones above; a bias on the AWQ case."""
    layer, deq, bias = loaded_linear(case, dtype, bias=case is CASES[0], device=DEVICE)
    layer.int4_kernel = "triton"  # what a CUDA sm80+ device chooses at process time
    layer.int4_sms = 8  # a few programs per row tile, so decode shapes take split-K
    for m in ROWS:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = reference(x, deq, bias)
        y = layer(x.to(DEVICE))
        assert y.dtype == dtype
        torch.testing.assert_close(y.float().cpu(), ref,
                                   **tol(ref, KERNEL_TOL[dtype]))


@pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=lambda c: c[0])
def test_one_row_kernel_in_place_unpack_matches(case):
    """The one-row kernel's IN_PLACE unpack (the default) gives the shifted unpack's products:
    every group size, split K."""
    from plugins.quant.int4.gemm import int4_gemv

    layer, deq, _ = loaded_linear(case, torch.float32, bias=False, device=DEVICE)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
    ref = reference(x, deq, None)
    args = (x.to(DEVICE), layer.w_q, layer.w_scales, layer.w_zeros, layer.int4_group, None, 8)
    base = int4_gemv(*args, {"IN_PLACE": False})
    fast = int4_gemv(*args)
    torch.testing.assert_close(fast.cpu(), base.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.float().cpu(), ref, **tol(ref, KERNEL_TOL[torch.float32]))


@pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1 with triton")
def test_decode_takes_split_k_and_empty_batches_work():
    from plugins.quant.int4.gemm import _config, int4_linear

    assert _config(1, 4096, 4096, 128, 132)["SPLIT_K"] > 1
    assert _config(2048, 4096, 4096, 128, 132)["SPLIT_K"] == 1  # the grid fills it
    layer, _, _ = loaded_linear(CASES[3], torch.float32, device=DEVICE)
    out = int4_linear(torch.empty(0, K, device=DEVICE), layer.w_q, layer.w_scales,
                      layer.w_zeros, layer.int4_group, None)
    assert out.shape == (0, sum(SHARDS.values()))


# ---- refusals and dummy weights ----

def test_non_trivial_g_idx_is_refused():
    layer = build_linear(quantization_config("gptq", 32), torch.float32, False)
    for shard, n in SHARDS.items():
        tensors, _ = gptq_tensors(torch.randn(n, K), 32)
        if shard == "k":  # act-order: groups permuted
            tensors["g_idx"] = tensors["g_idx"][torch.randperm(K)]
        for name, tensor in tensors.items():
            layer.weight_loader(getattr(layer, name), tensor, shard)
    with pytest.raises(ValueError, match="g_idx is not input // group_size"):
        layer.quant_method.process_weights_after_loading(layer)


def test_wrong_weight_shape_is_refused():
    layer = build_linear(quantization_config("compressed-tensors", 128), torch.float32, False)
    for shard, n in SHARDS.items():
        tensors, _ = pack_quantized_tensors(torch.randn(n, K), 128)
        if shard == "v":
            tensors["weight_shape"] = torch.tensor([n, K + 8])
        for name, tensor in tensors.items():
            layer.weight_loader(getattr(layer, name), tensor, shard)
    with pytest.raises(ValueError, match="weight_shape"):
        layer.quant_method.process_weights_after_loading(layer)


def test_shard_sizes_must_be_multiples_of_eight():
    with pytest.raises(ValueError, match="multiple of 8"):
        ctx = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"),
                              quant_method=Int4LinearMethod(
                                  parse_quant_config(quantization_config("awq", 128))))
        Linear(K, [40, 12], False, ctx, shard_names=["gate", "up"])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unloaded_defaults_process_cleanly(case):
    """Dummy-weight loading leaves integer tensors as created: they must pass the checks."""
    layer = build_linear(case[1], torch.float32, False)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.isfinite(layer(torch.randn(2, K))).all()


# ---- a tiny Llama served from an int4 checkpoint ----

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int4_llama(path, config: dict, make):
    """A tiny Llama whose linears are replaced by `make`'s checkpoint tensors; returns the
    transformers model carrying the dequantized weights (the reference)."""
    from model_fixtures import tiny_hf_model, write_tokenizer
    from safetensors.torch import save_file

    hf = tiny_hf_model("llama")
    state = {}
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if module.rsplit(".", 1)[-1] in LINEARS and leaf == "weight":
                tensors, deq = make(tensor.float())
                state.update({f"{module}.{n}": t.contiguous() for n, t in tensors.items()})
                hf.get_submodule(module).weight.copy_(deq)
            else:
                state[name] = tensor.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(path)
    return hf


MODEL_CASES = [("awq", quantization_config("awq", 32), lambda w: awq_tensors(w, 32)),
               ("gptq", quantization_config("gptq", 64), lambda w: gptq_tensors(w, 64)),
               ("gptq", quantization_config("compressed-tensors", 32, symmetric=False),
                lambda w: pack_quantized_tensors(w, 32, symmetric=False))]


@pytest.mark.parametrize("case", MODEL_CASES, ids=["awq", "gptq", "compressed-tensors"])
def test_tiny_llama_from_an_int4_checkpoint_matches_transformers(case, tmp_path):
    from model_fixtures import PagedHarness, cpu_plan, torch_native_backend
    from plugins_for_tests import builtin_backend_plugins

    import plugins.models
    import plugins.quant.int4 as int4
    from core.engine.loader import load_model, quant_scheme
    from core.plan.args import make_server_args
    from core.plan.registry import build_registry

    method, config, make = case
    hf = write_int4_llama(tmp_path / "m", config, make)
    registry = build_registry(extra=builtin_backend_plugins() + [
        ("quant_int4", int4), ("models_builtin", plugins.models)], entry_points=False)
    args = make_server_args(model_path=str(tmp_path / "m"), load_format="safetensors")
    plan = cpu_plan("llama")
    plan = dataclasses.replace(plan, quant_method=method,
                               quant_format=parse_quant_config(config).format)
    loaded = load_model(args, plan, registry)
    assert quant_scheme(loaded.hf_config, plan).format == plan.quant_format
    model, cfg = loaded.model, loaded.hf_config
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.int4_kernel == "dequant" and qkv.w_q.dtype == torch.int32

    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # the Triton kernel too (interpreter on a CPU), for one format: the model's real shapes
    interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    kernels = ["dequant"] + (["triton"] if TRITON_OK and interpreted and method == "awq" else [])
    for kernel in kernels:
        for module in model.modules():
            if hasattr(module, "int4_kernel"):
                module.int4_kernel = kernel
        h = PagedHarness(cfg.num_hidden_layers, cfg.num_key_value_heads,
                         cfg.hidden_size // cfg.num_attention_heads, 4,
                         backend=torch_native_backend(cfg, page_size=4))
        with torch.inference_mode():  # prefill 10, then decode 4
            b = h.batch([0], [ids[:10]])
            out = [model.compute_logits(model(b.input_ids, b.positions, b))]
            for t in ids[10:]:
                b = h.batch([0], [[t]], decode=True)
                out.append(model.compute_logits(model(b.input_ids, b.positions, b)))
        torch.testing.assert_close(torch.cat(out), ref, **tol(ref, 1e-4), msg=kernel)


# ---- the resolver ----

@pytest.fixture
def int4_registry(clean_plugin_env):
    from plugins_for_tests import builtin_backend_plugins

    import plugins.quant.int4 as int4
    from core.plan.registry import build_registry

    registry = build_registry(extra=builtin_backend_plugins() + [("quant_int4", int4)],
                              entry_points=False)
    assert not registry.failures, registry.failures
    return registry


def int4_spec(configs_dir, quant: dict):
    from core.plan.model_spec import spec_from_config

    raw = json.loads((configs_dir / "llama-3.1-8b.json").read_text())
    return spec_from_config(dict(raw, quantization_config=quant))


@pytest.mark.parametrize("quant,method,fmt", [
    (quantization_config("awq", 128), "awq", "int4_awq"),
    (quantization_config("gptq", 128), "gptq", "int4_gptq"),
    (quantization_config("compressed-tensors", 128), "gptq", "int4_pack")],
    ids=["awq", "gptq", "compressed-tensors"])
def test_resolver_picks_int4_on_h200_and_refuses_t4(quant, method, fmt, configs_dir,
                                                    int4_registry):
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.plan import ResolveError
    from core.plan.resolver import resolve

    spec = int4_spec(configs_dir, quant)
    for profile in ("h200", "h100", "x86-cpu"):
        plan = resolve(spec, PROFILES[profile], ServerArgs(), int4_registry)
        assert (plan.quant_method, plan.quant_format) == (method, fmt), profile
    with pytest.raises(ResolveError) as err:
        resolve(spec, PROFILES["t4"], ServerArgs(), int4_registry)
    assert f"{method}: needs CUDA sm80+ (device is sm75)" in err.value.reasons


def test_resolver_refuses_unsupported_int4_configs(configs_dir, int4_registry):
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.plan import ResolveError
    from core.plan.resolver import resolve

    odd_group = int4_spec(configs_dir, quantization_config("awq", 256))
    with pytest.raises(ResolveError) as err:
        resolve(odd_group, PROFILES["h200"], ServerArgs(), int4_registry)
    assert any(r.startswith("awq: group size 256 not supported") for r in err.value.reasons)
    act_order = int4_spec(configs_dir, dict(quantization_config("gptq", 128), desc_act=True))
    with pytest.raises(ResolveError, match="desc_act"):
        resolve(act_order, PROFILES["h200"], ServerArgs(), int4_registry)


def test_int4_methods_are_registered_through_entry_points():
    from core.plan.registry import get_registry

    registered = set(get_registry().kind("quant"))
    if not registered:
        pytest.skip("no quant plugins registered through entry points (core-serve not installed)")
    assert {"awq", "gptq"} <= registered, ("reinstall (pip install --no-deps -e .) so the "
                                           "quant_int4 entry point is current")


def test_dummy_weights_for_int4_configs_are_small_and_random(tmp_path):
    """--load-format dummy on an AWQ / GPTQ config: the method fills its packed tensors
    (core.contract.quant's optional init_dummy_weights), so the real weights are ~std, not all -8."""
    import dataclasses
    import json as _json

    from model_fixtures import cpu_plan, tiny_config

    from conformance.quant_refs_int4 import quantization_config
    from core.engine.loader import load_model
    from core.plan.args import make_server_args
    from core.plan.registry import build_registry

    for method, fmt in (("awq", "int4_awq"), ("gptq", "int4_gptq")):
        cfg = tiny_config("llama", hidden_size=128, intermediate_size=256).to_dict()
        cfg.update(architectures=["LlamaForCausalLM"],
                   quantization_config=quantization_config(method, 64, sym=True))
        (tmp_path / "config.json").write_text(_json.dumps(cfg))
        plan = dataclasses.replace(cpu_plan("llama"), quant_method=method, quant_format=fmt)
        loaded = load_model(make_server_args(model_path=str(tmp_path), load_format="dummy"),
                            plan, build_registry())
        down = loaded.model.model.layers[0].mlp.down_proj
        eye = torch.eye(256)
        w = down(eye).t()  # [N, K]: the real weight, through the method
        assert 0.002 < w.abs().mean() < 0.03 and w.std() > 0.002, (method, w.abs().mean())


@pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5], CASES[6]], ids=lambda c: c[0])
def test_one_row_gemv_and_one_launch_dequant(case):
    """int4_gemv (batch 1: FMA kernel, split K summed in order in-kernel) at several tiles, and
    int4_dequant (the prefill path's W^T for cuBLAS) equal to packing.dequantize."""
    from plugins.quant.int4 import gemm
    from plugins.quant.int4.packing import dequantize

    layer, deq, _ = loaded_linear(case, torch.float32, device=DEVICE)
    args = (layer.w_q, layer.w_scales, layer.w_zeros, layer.int4_group)
    bias = torch.randn(deq.shape[0], generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)).to(dtype)
        ref = reference(x, deq, bias)
        for cfg in (None, dict(BLOCK_N=32, BLOCK_K=64, num_warps=1, SPLIT_K=3, per_sm=1),
                    dict(BLOCK_N=64, BLOCK_K=32, num_warps=2, per_sm=16)):
            y = gemm.int4_gemv(x.to(DEVICE), *args, bias.to(dtype).to(DEVICE), 8, cfg)
            assert y.shape == (1, deq.shape[0]) and y.dtype == dtype
            torch.testing.assert_close(y.float().cpu(), ref, **tol(ref, KERNEL_TOL[dtype]
                                                                   if dtype != torch.bfloat16
                                                                   else 1e-2))
        w_t = gemm.int4_dequant(*args, dtype)
        if dtype != torch.bfloat16 or DEVICE == "cuda":  # the interpreter truncates to bf16
            assert torch.equal(w_t, dequantize(*args, dtype))
