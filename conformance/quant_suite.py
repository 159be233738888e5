"""The quant-method conformance tests: a method's linear layers against the fp32 product of
independently quantized weights (conformance/quant_refs.py), and a small model checkpoint in
the real file layout loaded through core's loader.

Collected by the conformance plugin (`pytest --conformance-quant NAME`, see
conformance.plugin), or by importing them into a test module:

    from conformance.quant_suite import *  # noqa: F401,F403

Parametrization: every registered quant method (or those named) x every reference case whose
format and checkpoint name it declares (QuantCaps.formats / config_names; a dense checkpoint
for a method that computes "dense" and loads "none"), plus the case of its quantization at load
(QuantCaps.online_scheme(): core's per-channel formats exactly, with per-token or no activation
quantization; a format of its own within conformance.quant_refs.bounded_slack of the dense
product, from its one weight_bits) x every suite device it can run on x every declared compute
dtype. A method named on the command line that declares nothing the suite can check, or whose
QuantCaps do not hold together (QuantCaps.declaration_errors), fails with the reason. Per
case: a stacked linear (three shards, with and without bias) loaded shard by shard under the
checkpoint's tensor names, processed, applied at M = 1, 4, 33, 300 (--conformance-full: up to
4096) and compared with fake-quantized x @ dequantized W^T in fp32 by relative Frobenius error;
output shape, dtype, device; x left unchanged. Then a two-layer Llama written as safetensors
with the case's quantization_config, loaded by core.engine.loader.load_model, each projection
checked the same way. Where the method declares MoE experts (QuantCaps.moe) and the case's
activations are dynamic, or the case holds experts in a form of its own (mxfp4: packed experts,
dense linears; conformance/quant_refs_mxfp4.py, an independent decoder of the OCP MX spec): a
MoE layer's experts loaded expert by expert under the checkpoint's names and run by every
runner that agrees with the method, against routing + fake-quantized x @ dequantized experts in
fp32, then the case's own format edges (mxfp4: a NaN scale, a refused odd shape). GGUF cases
(conformance/quant_refs_gguf.py: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantized and dequantized by the
`gguf` package) hand the method the loader's GGUFBlocks (dequantized first unless it
takes_raw_gguf), allow int8 per-block activations' error, and have no checkpoint test. Where it declares QuantCaps.tensor_parallel: two ranks' layers,
column- and row-parallel, against the ranks' own references (test_quant_linear_tensor_parallel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from conformance.attention_check import unavailable_reasons
from conformance.plugin import named_plugins
from conformance.quant_refs import RefCase, all_cases, fake_quant_acts, online_cases
from conformance.quant_refs_gguf import NO_CHECKPOINT
from conformance.suite_kit import default_devices
from conformance.suite_kit import device_info as _device_info
from conformance.suite_kit import device_missing as _device_missing
from core.contract.quant import QuantMethod, parse_quant_config
from core.layers import Linear, ModelContext
from core.layers.linear import process_weights_after_loading
from core.plan.registry import get_registry

__all__ = ["pytest_generate_tests", "test_quant_linear_conformance",
           "test_quant_checkpoint_conformance", "test_quant_moe_experts_conformance",
           "test_quant_linear_tensor_parallel"]

# fp32: the 8-bit tensor-core dots of GPUs accumulate a K step in less than fp32 (Hopper's fp8
# MMA keeps ~22 mantissa bits), hence not 1e-6; a wrong scale or layout is off by >1e-2.
TOL = {torch.float32: 5e-4, torch.float16: 5e-3, torch.bfloat16: 1.2e-2}
SIZES = (1, 4, 33, 300)
FULL_SIZES = (1, 2, 4, 8, 16, 33, 64, 128, 300, 1024, 4096)


def _serves(caps, case: RefCase) -> bool:
    """A checkpoint case the method declares it loads (online cases come from online_cases)."""
    if case.format not in caps.formats or case.online:
        return False
    return str(case.config["quant_method"]) in caps.config_names


# A dense checkpoint's weight as it is (the `unquantized` method's format).
DENSE = RefCase("dense", "dense", None, lambda w: ({"weight": w.clone()}, w), "none")


def method_cases(caps, cases: tuple[RefCase, ...] | None = None) -> list[RefCase]:
    """Every case the suite checks a method with these caps on: the checkpoints it loads, the
    dense one where it computes "dense" and loads "none", its quantization at load."""
    mine = [c for c in (all_cases() if cases is None else cases) if _serves(caps, c)]
    if "dense" in caps.formats and "none" in caps.config_names:
        mine.append(DENSE)
    if caps.online_format is not None and not caps.declaration_errors():
        online = caps.online_scheme()
        mine += online_cases(online.format, online.activations, online.weight_bits)
    return mine


@dataclass(frozen=True)
class Untestable:
    """A named method the suite cannot check here for a reason that is the method's own (it
    declares nothing the suite has a reference for, or caps that do not hold together): its
    test fails with `reason` rather than skipping."""

    reason: str


def _untestable_reason(name: str, caps, mine: list[RefCase]) -> str:
    errors = caps.declaration_errors()
    if errors:
        return f"{name}'s QuantCaps do not hold together: {'; '.join(errors)}"
    if mine:
        return ""
    online = caps.online_scheme()
    if online is not None:
        return (f"{name} quantizes at load into its own format {online.format!r} but declares "
                f"{len(caps.weight_bits) or 'no'} weight_bits: the suite bounds such a "
                "format's error by its one bit width (QuantCaps.weight_bits={N})")
    known = sorted({c.format for c in all_cases()})
    return (f"{name} declares nothing the suite has a reference for: formats "
            f"{', '.join(sorted(caps.formats)) or 'none'} loading "
            f"{', '.join(sorted(caps.config_names)) or 'nothing'}, no online_format (cases: "
            f"{', '.join(known)}, dense, and any online_format)")


def quant_params(config: pytest.Config, tensor_parallel: bool = False) -> list:
    """pytest.param objects (method, case, device, dtype) the options select. With
    `tensor_parallel`: the tensor-parallel check's, for the methods that declare
    QuantCaps.tensor_parallel only (the others are refused at --tp-size > 1 by the resolver,
    so there is nothing to check); when none is left, one skip saying why of each."""
    registry, methods, named = named_plugins(config, "quant", "conformance_quant",
                                             "quant method")
    devices = config.getoption("conformance_device", default=None) or default_devices()
    cases = all_cases()
    suffix = "-tp" if tensor_parallel else ""
    params, why_none = [], []
    for device_name in devices:
        device = torch.device(device_name)
        marks = [] if device.type == "cpu" else [pytest.mark.gpu]
        missing = _device_missing(device)
        info = _device_info(registry, device) if not missing else None
        for name in named or sorted(methods):
            reg = methods[name]
            if tensor_parallel and not reg.caps.tensor_parallel:
                if named:
                    why_none.append(f"{name} does not declare QuantCaps.tensor_parallel")
                continue
            mine = method_cases(reg.caps, cases)
            why = [missing] if missing else unavailable_reasons(reg, device, info)
            if why:
                if named and not tensor_parallel:
                    params.append(pytest.param(None, None, None, None, id=f"{name}-{device_name}",
                                               marks=[*marks, pytest.mark.skip(
                                                   reason="; ".join(why))]))
                why_none.append(f"{name} cannot run on {device_name}: {'; '.join(why)}")
                continue
            untestable = _untestable_reason(name, reg.caps, mine)
            if untestable:
                if named and not tensor_parallel:
                    params.append(pytest.param(name, Untestable(untestable), device_name, None,
                                               id=f"{name}-{device_name}-untestable",
                                               marks=marks))
                why_none.append(untestable)
                continue
            for case in mine:
                for dtype in sorted(reg.caps.dtypes):
                    params.append(pytest.param(
                        name, case, device_name, dtype, marks=marks,
                        id=f"{name}-{case.name}-{device_name}-{dtype}{suffix}"))
    if tensor_parallel and not params:
        declared = [n for n in named or sorted(methods) if methods[n].caps.tensor_parallel]
        reason = ("; ".join(dict.fromkeys(why_none)) if declared or named else
                  "no selected quant method declares QuantCaps.tensor_parallel")
        params.append(pytest.param(None, None, None, None, id="no-tensor-parallel",
                                   marks=pytest.mark.skip(reason=reason)))
    return params


def _moe_applies(param) -> bool:
    name, case = param.values[0], param.values[1]
    if name is None:
        return True  # a named method that cannot run here: keep its skip
    if isinstance(case, Untestable):
        return False  # fails once, in test_quant_linear_conformance
    return get_registry().get("quant", name).caps.moe and (
        case.experts is not None  # a format of its own for experts (mxfp4)
        or case.format != "fp8_tensor" and case.acts not in ("fp8_static", "none"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "quant_case" in metafunc.fixturenames:
        fn = metafunc.function.__name__
        params = quant_params(metafunc.config,
                              tensor_parallel=fn == "test_quant_linear_tensor_parallel")
        if fn == "test_quant_moe_experts_conformance":
            # Methods with MoE experts (QuantCaps.moe), dynamic activations, channel or block
            # weights, or a case with its own expert form; the others have nothing to check.
            params = [p for p in params if _moe_applies(p)] or [pytest.param(
                None, None, None, None, id="no-moe-experts", marks=pytest.mark.skip(
                    reason="no selected quant method declares MoE experts (QuantCaps.moe) "
                           "for a case with dynamic activations"))]
        elif fn != "test_quant_linear_conformance":  # an untestable method fails once
            params = [p for p in params if not isinstance(p.values[1], Untestable)]
        if fn == "test_quant_checkpoint_conformance":
            # GGUF cases: their checkpoint is one .gguf file, which this suite does not write
            kept = [p for p in params if not _gguf_file(p.values[1])]
            params = kept if kept or len(kept) == len(params) else [pytest.param(
                None, None, None, None, id="gguf-file", marks=pytest.mark.skip(
                    reason="a GGUF checkpoint is one .gguf file, which this suite does not "
                           "write (the GGUF cases' linears are checked)"))]
        metafunc.parametrize("quant_name,quant_case,quant_device,quant_dtype", params)


def _gguf_file(case) -> bool:
    return isinstance(case, RefCase) and NO_CHECKPOINT in case.tags


def _method(name: str, case: RefCase) -> QuantMethod:
    """The method as the loader builds it: the online case's scheme is the one the method
    declares (QuantCaps.online_scheme()), a checkpoint case's is its config's."""
    reg = get_registry().get("quant", name)
    scheme = reg.caps.online_scheme() if case.online else parse_quant_config(case.config)
    method = reg.load()(scheme)
    assert isinstance(method, QuantMethod), (
        f"{name}'s factory gave a {type(method).__name__}, not a "
        "core.contract.quant.QuantMethod: subclass it")
    return method


def _as_loaded(t, method, device: torch.device):
    """A case's tensor as core's loader hands it to the method: a tensor on the device, or GGUF
    blocks (core.engine.gguf_weights.GGUFBlocks) as host bytes to a method that takes raw GGUF
    (QuantMethod.takes_raw_gguf) and dequantized to fp32 for any other."""
    method = getattr(method, "quant_method", method)  # a ModelContext or the method itself
    if isinstance(t, torch.Tensor):
        return t.to(device)
    return t if method.takes_raw_gguf else t.dequantize().to(device)


def _weights(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """fp32 weights already rounded to the compute dtype (what a dense checkpoint holds)."""
    return (torch.randn(n, k, generator=gen) * 0.05).to(dtype).float()


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str,
           slack: float = 0.0) -> None:
    """Relative Frobenius error within the dtype's tolerance (+ a bounded case's slack)."""
    err = ((y.float().cpu() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    tol = TOL[dtype] + slack
    assert err <= tol, (f"{what}: relative error {err:.2e} > {tol:.1e}"
                        + (f" (dtype {TOL[dtype]:.1e} + quantization bound {slack:.1e})"
                           if slack else ""))


def _slack(case: RefCase, x: torch.Tensor, w: torch.Tensor) -> float:
    return case.slack(x, w) if case.slack is not None else 0.0


def test_quant_linear_conformance(quant_name, quant_case, quant_device, quant_dtype, request):
    if isinstance(quant_case, Untestable):
        pytest.fail(quant_case.reason, pytrace=False)
    case, device, dtype = quant_case, torch.device(quant_device), getattr(torch, quant_dtype)
    seed = request.config.getoption("conformance_seed", default=0)
    gen = torch.Generator().manual_seed(seed)
    k = max(256, case.k_multiple)
    shards = [2 * case.n_multiple * 3, case.n_multiple * 2, case.n_multiple * 2]
    sizes = FULL_SIZES if request.config.getoption("conformance_full", default=False) else SIZES
    for bias in (False, True):
        ctx = ModelContext(dtype=dtype, device=device, quant_method=_method(quant_name, case))
        layer = Linear(k, shards, bias, ctx, shard_names=["q", "k", "v"])
        deq = []
        for shard, n in zip(("q", "k", "v"), shards, strict=True):
            tensors, d = case.build(_weights(n, k, dtype, gen))
            deq.append(d)
            for suffix, t in tensors.items():
                layer.weight_loader(getattr(layer, suffix), _as_loaded(t, ctx, device), shard)
        b = (torch.randn(sum(shards), generator=gen) * 0.1).to(dtype) if bias else None
        if bias:
            layer.weight_loader(layer.bias, b.to(device), None)
        process_weights_after_loading(layer)
        w = torch.cat(deq)
        for m in sizes:
            x = torch.randn(m, k, generator=gen).to(dtype)
            xd = x.to(device)
            before = xd.clone()
            y = layer(xd)
            assert y.shape == (m, sum(shards)) and y.dtype == dtype and y.device.type == \
                device.type, f"output {tuple(y.shape)} {y.dtype} {y.device}"
            assert torch.equal(xd, before), "apply changed its input"
            ref = fake_quant_acts(x, case.acts, case.static_scale) @ w.t()
            if bias:
                ref = ref + b.float()
            _check(y, ref, dtype, f"M={m} bias={bias}", _slack(case, x, w))
        # Three leading dims, as layers pass them.
        x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
        y3 = layer(x3.to(device))
        assert y3.shape == (2, 3, sum(shards))


def test_quant_linear_tensor_parallel(quant_name, quant_case, quant_device, quant_dtype,
                                     request):
    """A method declaring QuantCaps.tensor_parallel: each of 2 ranks loads its part of the same
    checkpoint tensors (rows of a column-parallel [q, k, v] layer, inputs of a row-parallel
    one), and the ranks' outputs, concatenated (column) or summed (row, the all-reduce left
    out), are checked against the ranks' own references. The rule (core.contract.quant): a
    column-parallel rank sees all of x, so its rows are the whole layer's; a row-parallel rank
    sees only its slice of x, so dynamic activation scales are the slice's own (per token over
    the rank's inputs) and an online method quantizes its slice of W alone: the reference is
    the sum over ranks of fake-quantized x_r @ the rank's dequantized W_r, plus the bias (added
    by rank 0 only). No process group: the checks run the ranks one by one."""
    from core.engine.distributed import TPGroup

    case, device, dtype = quant_case, torch.device(quant_device), getattr(torch, quant_dtype)
    gen = torch.Generator().manual_seed(request.config.getoption("conformance_seed",
                                                                 default=0))
    k = 2 * max(256, case.k_multiple)
    shards = [2 * case.n_multiple * 2, case.n_multiple * 2, case.n_multiple * 2]
    dense = [_weights(n, k, dtype, gen) for n in shards]
    whole = [case.build(w) for w in dense]
    x = torch.randn(8, k, generator=gen).to(dtype)

    def layer(tp: TPGroup, parallel: str, out_sizes: list[int], in_size: int):
        ctx = ModelContext(dtype=dtype, device=device, quant_method=_method(quant_name, case),
                           tp=tp)
        names = ["q", "k", "v"] if len(out_sizes) == 3 else None
        return Linear(in_size, out_sizes if names else out_sizes[0], True, ctx,
                      shard_names=names, parallel=parallel, reduce=False)

    def fill(lin: Linear, parts: list, names: list | None, bias: torch.Tensor) -> Linear:
        for shard, (tensors, _) in zip(names or [None], parts, strict=True):
            for suffix, t in tensors.items():
                lin.weight_loader(getattr(lin, suffix), _as_loaded(t, lin.quant_method, device),
                                  shard)
        lin.weight_loader(lin.bias, bias.to(device), None)
        process_weights_after_loading(lin)
        return lin

    def ref(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fake_quant_acts(xs.float(), case.acts, case.static_scale) @ w.t()

    b = (torch.randn(sum(shards), generator=gen) * 0.1).to(dtype)
    cols = [fill(layer(TPGroup(r, 2), "column", shards, k), whole, ["q", "k", "v"], b)(
        x.to(device)) for r in range(2)]
    # rank r's output holds its rows of q, then of k, then of v
    parts = [torch.cat([c.split([n // 2 for n in shards], dim=-1)[i] for c in cols], dim=-1)
             for i in range(3)]
    w = torch.cat([deq for _, deq in whole])
    _check(torch.cat(parts, dim=-1).float(), ref(x, w) + b.float(), dtype, "column-parallel",
           _slack(case, x, torch.cat(dense)))

    n, half = shards[0], k // 2
    b_row = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    total, expect = 0, b_row.float()
    for r in range(2):
        cut = slice(r * half, (r + 1) * half)
        total = total + fill(layer(TPGroup(r, 2), "row", [n], k), [whole[0]], None, b_row)(
            x[:, cut].to(device)).float()
        # what rank r holds: its inputs of the checkpoint's weight, or of the dense weight
        # quantized by itself (online)
        w_r = case.build(dense[0][:, cut])[1] if case.online else whole[0][1][:, cut]
        expect = expect + ref(x[:, cut], w_r)
    _check(total, expect, dtype, "row-parallel (each rank's activations quantized on its "
           "own inputs; the bias added by rank 0 only)", _slack(case, x, dense[0]))


# ---- a small checkpoint in the real file layout, through the loader ----

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_checkpoint(tmp, case: RefCase, dtype: torch.dtype, seed: int):
    """A 2-layer Llama: config.json with the case's quantization_config, model.safetensors with
    every projection in the case's tensors; returns {HF projection name: dequantized W}."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, inter = 256, 512
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
    raw = cfg.to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    if case.config is not None:
        raw["quantization_config"] = case.config
    (tmp / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (256, hidden), "k_proj": (128, hidden), "v_proj": (128, hidden),
              "o_proj": (hidden, 256), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    tensors, dense = {}, {}
    for layer in range(2):
        for proj, (n, k) in shapes.items():
            part = "self_attn" if proj[0] in "qkvo" else "mlp"
            name = f"model.layers.{layer}.{part}.{proj}"
            built, dense[name] = case.build(_weights(n, k, dtype, gen))
            tensors.update({f"{name}.{s}": t.contiguous() for s, t in built.items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(hidden)
    tensors["model.embed_tokens.weight"] = torch.randn(512, hidden, generator=gen) * 0.02
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = torch.randn(512, hidden, generator=gen) * 0.02
    save_file(tensors, str(tmp / "model.safetensors"))
    return dense


def test_quant_checkpoint_conformance(quant_name, quant_case, quant_device, quant_dtype,
                                      tmp_path, request):
    from core.engine.loader import load_model
    from core.plan.args import ServerArgs
    from core.plan.model_spec import load_model_spec
    from core.plan.resolver import resolve

    case, device, dtype = quant_case, torch.device(quant_device), getattr(torch, quant_dtype)
    seed = request.config.getoption("conformance_seed", default=0)
    dense = _write_checkpoint(tmp_path, case, dtype, seed)
    registry = get_registry()
    args = ServerArgs(model_path=str(tmp_path), dtype=quant_dtype, device=quant_device,
                      quantization=quant_name, load_format="safetensors")
    plan = resolve(load_model_spec(str(tmp_path)), _device_info(registry, device), args,
                   registry)
    assert plan.quant_method == quant_name
    model = load_model(args, plan, registry, tokenizer=False).model
    modules = dict(model.named_modules())
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in range(2):
        for ours, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                            ("self_attn.o_proj", ("o_proj",)),
                            ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
                            ("mlp.down_proj", ("down_proj",))):
            prefix = f"model.layers.{layer}."
            lin = modules[prefix + ours]
            w = torch.cat([dense[f"{prefix}{ours.split('.')[0]}.{p}"] for p in parts])
            x = torch.randn(5, w.shape[1], generator=gen).to(dtype)
            ref = fake_quant_acts(x, case.acts, case.static_scale) @ w.t()
            _check(lin(x.to(device)), ref, dtype, f"{prefix}{ours}", _slack(case, x, w))


# ---- MoE experts ----

def _moe_runners_for(name: str, fmt: str, device: torch.device) -> list[tuple[str, object]]:
    """Every registered MoE runner that runs this method's experts in this format on `device`
    (caps agreement from either side), by name."""
    from core.plan.checks import check_device, check_moe_format, check_moe_quant

    registry = get_registry()
    quant_caps = registry.get("quant", name).caps
    info = _device_info(registry, device)
    return [(runner, reg.load()()) for runner, reg in sorted(registry.kind("moe").items())
            if not check_device(reg.caps, info)
            and not check_moe_quant(runner, reg.caps, name, quant_caps)
            and not check_moe_format(runner, reg.caps, fmt, quant_caps)]


def test_quant_moe_experts_conformance(quant_name, quant_case, quant_device, quant_dtype,
                                       request):
    case, device = quant_case, torch.device(quant_device)
    runners = _moe_runners_for(quant_name, case.format, device)
    if not runners:
        pytest.skip(f"no registered MoE runner runs {quant_name} experts on {quant_device}")
    for name, runner in runners:
        _check_moe_experts(quant_name, case, device, getattr(torch, quant_dtype), runner,
                           request.config.getoption("conformance_seed", default=0), name)


class MoEExpertsCase:
    """A MoE layer of 4 experts (top-2) over this method's quantized experts, and its fp32
    reference: the activations quantized as the case's are, each expert's intermediate rounded
    to the compute dtype (what a runner stores between its two products). Shared with
    bench/diag_moe_fp8.py, which times nothing and checks tilings one by one."""

    def __init__(self, quant_name: str, case: RefCase, device: torch.device,
                 dtype: torch.dtype, runner, seed: int, hidden: int = 256, inter: int = 256,
                 tamper=None):
        """tamper(expert, proj, tensors): edits one expert projection's checkpoint tensors
        before they load (a case's moe_edges); the reference then no longer holds."""
        from core.layers import MoE

        self.case, self.dtype, self.top_k, self.device = case, dtype, 2, device
        self.gen = gen = torch.Generator().manual_seed(seed)
        experts = 4
        build = case.experts or case.build
        ctx = ModelContext(dtype=dtype, device=device, quant_method=_method(quant_name, case),
                           moe_runner=runner)
        self.moe = moe = MoE(experts, self.top_k, hidden, inter, ctx)
        self.w13, self.w2 = [], []
        for e in range(experts):
            parts = {}
            for proj, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                 ("down", (hidden, inter))):
                tensors, parts[proj] = build(_weights(n, k, dtype, gen) * 4)
                if tamper is not None:
                    tamper(e, proj, tensors)
                stacked = "w2" if proj == "down" else "w13"
                for suffix, t in tensors.items():
                    moe.weight_loader(getattr(moe, f"{stacked}_{suffix}"), t.to(device),
                                      f"{e}.{proj}")
            self.w13.append(torch.cat([parts["gate"], parts["up"]]))
            self.w2.append(parts["down"])
        moe.gate.weight.data.copy_((torch.randn(experts, hidden, generator=gen) * 0.1).to(dtype))
        process_weights_after_loading(moe)

    def inputs(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.moe.gate.weight.shape[1], generator=self.gen).to(self.dtype)

    def reference(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [m, hidden] fp32, intermediates [m * top_k, inter] in the compute dtype, row
        t * top_k + j being token t's j-th expert by routing weight)."""
        acts = self.case.acts
        scores = torch.softmax(x.float() @ self.moe.gate.weight.float().cpu().t(), -1)
        top_w, top_i = scores.topk(self.top_k, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        ref = torch.zeros(x.shape[0], self.w2[0].shape[0])
        inter = []
        for t in range(x.shape[0]):
            for wt, e in zip(top_w[t].tolist(), top_i[t].tolist(), strict=True):
                g, u = (fake_quant_acts(x[t:t + 1], acts) @ self.w13[e].t()).chunk(2, -1)
                h = (torch.nn.functional.silu(g) * u).to(self.dtype)
                inter.append(h[0])
                ref[t] += wt * (fake_quant_acts(h, acts) @ self.w2[e].t())[0]
        return ref, torch.stack(inter)


def _check_moe_experts(quant_name, case, device, dtype, runner, seed: int, runner_name: str):
    """One runner's MoE layer over this method's experts against the fp32 reference."""
    c = MoEExpertsCase(quant_name, case, device, dtype, runner, seed)
    for m in (1, 7, 64):
        x = c.inputs(m)
        with torch.no_grad():
            y = c.moe(x.to(device))
        ref, _ = c.reference(x)
        assert y.shape == (m, ref.shape[1]) and y.dtype == dtype
        _check(y, ref, dtype, f"{runner_name} experts M={m}")
    if case.moe_edges is not None:  # the format's own edges (e.g. mxfp4's NaN scale)
        case.moe_edges(lambda hidden, inter, tamper: MoEExpertsCase(
            quant_name, case, device, dtype, runner, seed, hidden, inter, tamper))
