"""The quant-method contract: `QuantMethod` is a base class whose every member is real (core
calls them, never probes), and what a third-party method can declare: an online weight-only
method (a format of core's or its own), the tensor-parallel rule for dynamic activations, and
declarations that do not hold together, answered with reasons (resolver) or a failing test
(conformance suite) rather than a traceback or an all-skipped run."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from installed_plugin import child_env, install
from torch import nn

from core.contract.capabilities import QuantCaps
from core.contract.hookspecs import hookimpl
from core.contract.quant import QuantMethod, online_scheme
from core.layers import Linear, ModelContext, MoE, process_weights_after_loading
from core.layers.linear import DenseLinearMethod, repack_dense_weights
from core.plan.args import ServerArgs
from core.plan.devices import PROFILES
from core.plan.plan import ResolveError
from core.plan.registry import build_registry
from core.plan.resolver import explain, resolve

REPO = Path(__file__).resolve().parent.parent

# ---- the base class ----

OPTIONAL = ("weight_loader", "process_weights_after_loading", "bind", "init_dummy_weights",
            "repack", "load_table", "load_summary", "create_moe_weights",
            "process_moe_weights_after_loading", "moe_weights")


def test_every_member_is_on_the_base_class_with_a_docstring():
    doc = inspect.getmodule(QuantMethod).__doc__
    assert QuantMethod.__abstractmethods__ == {"create_weights", "apply"}
    for name in ("create_weights", "apply", *OPTIONAL):
        member = getattr(QuantMethod, name)
        assert member.__doc__, name
        assert name in doc, f"{name} missing from core.contract.quant's table"
    assert QuantMethod.takes_raw_gguf is False and "takes_raw_gguf" in doc


@pytest.mark.parametrize("name", ["unquantized", "fp8", "w8a8_int8", "awq", "gptq", "gguf_c"])
def test_every_builtin_method_subclasses_it(name):
    cls = build_registry().get("quant", name).load()
    assert issubclass(cls, QuantMethod), cls


class Minimal(QuantMethod):
    """Only the two required members: everything else is the base class's default."""

    def create_weights(self, layer, input_size, output_size, bias, dtype, device):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                    requires_grad=False)
        layer.bias = None

    def apply(self, layer, x):
        return x @ layer.weight.t() * 2


def test_a_method_with_only_the_required_members_runs_everywhere_core_calls_it():
    m = Minimal()
    lin = Linear(8, [4, 4], False, ModelContext(quant_method=m), shard_names=["a", "b"])
    w = torch.randn(4, 8)
    lin.weight_loader(lin.weight, w, "b")  # the default weight_loader: mark()/load_shard
    assert torch.equal(lin.weight[4:], w)
    # shard "a" too: create_weights leaves the rows uninitialized (NaN would fail the product's
    # comparison below at random)
    lin.weight_loader(lin.weight, torch.randn(4, 8), "a")
    process_weights_after_loading(lin)
    repack_dense_weights(lin, lambda t: t.t().contiguous(), None)  # default repack: nothing
    assert torch.equal(lin.weight[4:], w)
    x = torch.randn(3, 8)
    assert torch.equal(lin.bound()(x), x @ lin.weight.t() * 2)  # default bind
    assert m.load_table(lin, w) is None and m.load_summary() is None
    assert m.moe_weights(lin) is None and m.scheme.format == "dense"
    with pytest.raises(ValueError, match="does not hold MoE expert weights"):
        m.create_moe_weights(lin, 2, 8, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="abstract"):
        type("NoApply", (QuantMethod,), {"create_weights": Minimal.create_weights})()


def test_moe_layer_takes_the_dense_form_when_moe_weights_gives_none():
    runner = build_registry().get("moe", "torch_native").load()()
    moe = MoE(2, 1, 8, 4, ModelContext(quant_method=DenseLinearMethod(), moe_runner=runner))
    process_weights_after_loading(moe)  # the default process_moe_weights_after_loading
    got = moe.weights()
    assert got.form == "unquantized" and got.w13 is moe.w13_weight


LOOKUPS = ("getattr", "hasattr")
METHOD_NAMES = re.compile(r"quant_method|table_method|expert|\bquant\b|\bmethod\b")


@pytest.mark.parametrize("path", ["core/layers/linear.py", "core/layers/moe.py",
                                  "core/layers/embedding.py", "core/engine/loader.py"])
def test_core_calls_quant_method_members_without_probing(path):
    """No getattr / hasattr on a quant method object (a module's own attributes, such as
    `expert_quant_method` on a MoE layer, may still be looked up)."""
    tree = ast.parse((REPO / path).read_text())
    probes = [ast.unparse(n) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in LOOKUPS and n.args
              and METHOD_NAMES.search(ast.unparse(n.args[0]))]
    assert not probes, probes


def test_the_loader_refuses_a_method_that_is_not_a_quant_method(clean_plugin_env):
    from core.engine.loader import make_quant_method

    class Duck:
        def __init__(self, scheme):
            pass

    class Plugin:
        @hookimpl
        def core_register_quant_methods(self, register):
            register("duck", QuantCaps(devices={"cpu"}, config_names={"duck"}), Duck)

    registry = build_registry(extra=[("ducks", Plugin())], entry_points=False)
    with pytest.raises(TypeError, match=r"'duck' \(<in-process> \(ducks\)\) gave a Duck, not "
                                        r"a core.contract.quant.QuantMethod: subclass it"):
        make_quant_method(registry, "duck", online_scheme("fp8_channel"))


# ---- online weight-only methods: declared, resolved, loaded ----

WEIGHT_ONLY_OWN = QuantCaps(devices={"cpu"}, formats={"int8_wo"}, activation_schemes={"none"},
                            online_format="int8_wo", weight_bits={8})
# what the outside author declared first: core's format, no activation quantization
WEIGHT_ONLY_CORE = QuantCaps(devices={"cpu"}, formats={"int8_channel"},
                             activation_schemes={"none"}, online_format="int8_channel",
                             weight_bits={8})


def _registry(**methods):
    from plugins_for_tests import builtin_backend_plugins, double_factory

    class Plugin:
        @hookimpl
        def core_register_quant_methods(self, register):
            for name, caps in methods.items():
                register(name, caps, double_factory)

    return build_registry(extra=builtin_backend_plugins() + [("third", Plugin())],
                          entry_points=False)


def test_an_online_weight_only_method_of_its_own_format_is_planned(model_spec,
                                                                   clean_plugin_env):
    registry = _registry(int8_wo=WEIGHT_ONLY_OWN)
    plan = resolve(model_spec("qwen3-8b"), PROFILES["x86-cpu"],
                   ServerArgs(quantization="int8_wo"), registry)
    assert (plan.quant_method, plan.quant_format) == ("int8_wo", "int8_wo")
    note = next(n for n in plan.notes if "quantizes the dense checkpoint at load" in n)
    assert "int8_wo, w8a16, online" in note, note
    assert "int8_wo (int8_wo)" in explain(plan)


def test_an_online_weight_only_method_of_a_core_format_is_planned(model_spec, clean_plugin_env):
    registry = _registry(wo_core=WEIGHT_ONLY_CORE)
    plan = resolve(model_spec("qwen3-8b"), PROFILES["x86-cpu"],
                   ServerArgs(quantization="wo_core"), registry)
    assert (plan.quant_method, plan.quant_format) == ("wo_core", "int8_channel")
    assert WEIGHT_ONLY_CORE.online_scheme().activations == "none"
    # the built-in W8A8 methods are unchanged: dynamic per-token activations
    for name in ("fp8", "w8a8_int8"):
        scheme = build_registry().get("quant", name).caps.online_scheme()
        assert scheme == online_scheme(scheme.format) and scheme.activations == "dynamic"


def test_the_loader_builds_the_method_with_the_scheme_the_resolver_planned(model_spec,
                                                                           clean_plugin_env):
    from core.engine.loader import quant_scheme

    registry = _registry(wo_core=WEIGHT_ONLY_CORE, int8_wo=WEIGHT_ONLY_OWN)
    for name, fmt in (("wo_core", "int8_channel"), ("int8_wo", "int8_wo")):
        plan = resolve(model_spec("qwen3-8b"), PROFILES["x86-cpu"],
                       ServerArgs(quantization=name), registry)
        scheme = quant_scheme(object(), plan, registry)  # a config without quantization
        assert (scheme.format, scheme.activations, scheme.online, scheme.weight_bits) == (
            fmt, "none", True, 8)


@pytest.mark.parametrize("caps,needle", [
    (replace(WEIGHT_ONLY_OWN, formats={"int8_channel"}),
     "online_format 'int8_wo' is not among its formats (int8_channel)"),
    (replace(WEIGHT_ONLY_OWN, online_activations="static"),
     "online_activations 'static' is neither 'dynamic' nor 'none'"),
    (replace(WEIGHT_ONLY_CORE, activation_schemes={"static"}),
     "its online quantization's dynamic activations (online_activations unset) are not among "
     "its activation_schemes (static)"),
    (replace(WEIGHT_ONLY_CORE, weight_bits={4}),
     "online_format 'int8_channel' holds 8-bit weights, not among its weight_bits (4)"),
    (replace(WEIGHT_ONLY_OWN, online_format="dense"), "names no format the weights become"),
])
def test_online_declarations_that_do_not_hold_are_reasons_not_tracebacks(
        caps, needle, model_spec, clean_plugin_env):
    assert any(needle in e for e in caps.declaration_errors()), caps.declaration_errors()
    with pytest.raises(ResolveError) as err:
        resolve(model_spec("qwen3-8b"), PROFILES["x86-cpu"], ServerArgs(quantization="bad"),
                _registry(bad=caps))
    text = str(err.value)
    assert "--quantization bad cannot quantize the checkpoint at load: its QuantCaps " \
           "(<in-process> (third)) do not hold together" in text and needle in text, text


def test_online_scheme_takes_any_format_and_refuses_static_activations():
    assert online_scheme("fp8_channel") == online_scheme("fp8_channel", "dynamic", 4)
    assert online_scheme("int8_wo", "none", 8).describe() == "int8_wo, w8a16, online"
    with pytest.raises(ValueError, match="static scales need a calibrated checkpoint"):
        online_scheme("int8_channel", "static")
    with pytest.raises(ValueError, match="no online quantization into 'dense'"):
        online_scheme("dense")


def test_an_unknown_quantization_names_plugins_that_failed_to_load(model_spec,
                                                                   clean_plugin_env):
    class Broken:
        @hookimpl
        def core_register_quant_methods(self, register):
            raise RuntimeError("caps do not build")

    from plugins_for_tests import builtin_backend_plugins

    registry = build_registry(extra=builtin_backend_plugins() + [("broken", Broken())],
                              entry_points=False)
    with pytest.raises(ResolveError) as err:
        resolve(model_spec("qwen3-8b"), PROFILES["x86-cpu"],
                ServerArgs(quantization="int8_wo"), registry)
    assert "plugin <in-process> (broken) failed to load (register): RuntimeError: caps do " \
           "not build" in str(err.value)


# ---- the conformance suite on a third-party package ----

PACKAGE = '''
"""Third-party quant methods written against core.contract only, as a pip package would."""
import torch
from torch import nn

from core.contract.capabilities import QuantCaps
from core.contract.hookspecs import hookimpl
from core.contract.quant import QuantMethod, reciprocal

CORE_PLUGIN_API = ">=1.2,<2"


class Int8Online(QuantMethod):
    """A dense checkpoint's weights to int8 per output channel at load (amax / 127); x as is,
    or quantized per token (amax / 127) where the scheme says dynamic."""

    def create_weights(self, layer, input_size, output_size, bias, dtype, device):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype,
                                                device=device), requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype, device=device),
                                   requires_grad=False) if bias else None)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data.float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.0
        layer.weight = nn.Parameter(torch.round(w / scale).clamp(-128, 127).to(torch.int8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x):
        xf = x.float()
        if self.scheme.activations == "dynamic":
            s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
            xf = torch.round(xf * reciprocal(s)).clamp(-128, 127) * s
        y = xf @ (layer.weight.float() * layer.weight_scale).t()
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(x.dtype)


F32 = {"float32"}


@hookimpl
def core_register_quant_methods(register):
    # weight-only into a format of its own name, and into core's int8_channel
    register("tp_wo_own", QuantCaps(devices={"cpu"}, formats={"int8_wo"}, dtypes=F32,
                                    activation_schemes={"none"}, online_format="int8_wo",
                                    weight_bits={8}), Int8Online)
    register("tp_wo_core", QuantCaps(devices={"cpu"}, formats={"int8_channel"}, dtypes=F32,
                                     activation_schemes={"none"},
                                     online_format="int8_channel", weight_bits={8}),
             Int8Online)
    # W8A8 with per-token dynamic activations, split over tensor-parallel ranks
    register("tp_dyn", QuantCaps(devices={"cpu"}, formats={"int8_channel"}, dtypes=F32,
                                 activation_schemes={"dynamic"}, online_format="int8_channel",
                                 weight_bits={8}, tensor_parallel=True), Int8Online)
    # nothing the suite can check, and a declaration that does not hold together
    register("tp_nothing", QuantCaps(devices={"cpu"}, config_names={"xyz"}, formats={"xyz"},
                                     dtypes=F32), Int8Online)
    register("tp_no_bits", QuantCaps(devices={"cpu"}, formats={"int4_own"}, dtypes=F32,
                                     activation_schemes={"none"}, online_format="int4_own"),
             Int8Online)
    register("tp_bad", QuantCaps(devices={"cpu"}, formats={"int8_channel"}, dtypes=F32,
                                 activation_schemes={"none"}, online_format="int8_wo"),
             Int8Online)
'''


@pytest.fixture(scope="module")
def third_party(tmp_path_factory) -> Path:
    """The package and its dist-info (as `pip install --target` leaves them), and an empty
    project folder to run pytest in."""
    root = tmp_path_factory.mktemp("quant_tp")
    install(root / "site", "tp_quant", PACKAGE)
    (root / "project").mkdir()
    return root


def _run_suite(third_party: Path, *names: str) -> tuple[int, str, dict[str, str]]:
    env = child_env(third_party / "site")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
         "--conformance-device", "cpu", "--conformance-quant", ",".join(names)],
        cwd=third_party / "project", env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    results = dict(re.findall(r"::(test_quant_\w+\[[^\]]+\]) (PASSED|FAILED|SKIPPED)",
                              proc.stdout))
    return proc.returncode, out, results


def test_a_third_party_package_runs_the_quant_suite(third_party):
    """Weight-only online methods (own format: bounded; core's: exact) are run, not skipped;
    per-token dynamic activations pass the row-parallel check against the per-rank
    reference; a method with nothing testable, or caps that do not hold, fails saying why."""
    rc, out, results = _run_suite(third_party, "tp_wo_own", "tp_wo_core", "tp_dyn",
                                  "tp_nothing", "tp_no_bits", "tp_bad")
    assert rc == 1, out
    passed = {k for k, v in results.items() if v == "PASSED"}
    failed = {k for k, v in results.items() if v == "FAILED"}
    for test in ("test_quant_linear_conformance", "test_quant_checkpoint_conformance"):
        assert f"{test}[tp_wo_own-int8_wo-online-w8a16-bounded-cpu-float32]" in passed, out
        assert f"{test}[tp_wo_core-int8-online-weight-only-cpu-float32]" in passed, out
        assert f"{test}[tp_dyn-int8-online-cpu-float32]" in passed, out
    assert "test_quant_linear_tensor_parallel[tp_dyn-int8-online-cpu-float32-tp]" in passed, out
    assert failed == {f"test_quant_linear_conformance[{n}-cpu-untestable]"
                      for n in ("tp_nothing", "tp_no_bits", "tp_bad")}, out
    assert "tp_nothing declares nothing the suite has a reference for: formats xyz" in out
    assert "tp_no_bits quantizes at load into its own format 'int4_own' but declares no " \
           "weight_bits" in out
    assert "tp_bad's QuantCaps do not hold together: online_format 'int8_wo' is not among " \
           "its formats (int8_channel)" in out


def test_the_tensor_parallel_skip_says_why_of_each_method(clean_plugin_env):
    """The old message said no method declared tensor_parallel when one did but could not
    run here."""
    from conformance import quant_suite
    from core.plan import registry as plugins

    class Plugin:
        @hookimpl
        def core_register_quant_methods(self, register):
            register("tp_cuda_only", QuantCaps(devices={"cuda"}, formats={"int8_channel"},
                                               online_format="int8_channel",
                                               tensor_parallel=True), DenseLinearMethod)

    class Config:
        def __init__(self, *names):
            self.options = {"conformance_quant": [",".join(names)],
                            "conformance_device": ["cpu"]}

        def getoption(self, name, default=None):
            return self.options.get(name, default)

    plugins.add_plugin("tp_cuda", Plugin())
    try:
        [skip] = quant_suite.quant_params(Config("tp_cuda_only"), tensor_parallel=True)
        both = quant_suite.quant_params(Config("tp_cuda_only", "unquantized"),
                                        tensor_parallel=True)
        none = quant_suite.quant_params(Config("w8a8_int8"), tensor_parallel=True)
    finally:
        plugins.remove_plugin("tp_cuda")
    reason = skip.marks[0].kwargs["reason"]
    assert reason.startswith("tp_cuda_only cannot run on cpu: "), reason
    # unquantized's cases: the dense checkpoint and the GGUF files it dequantizes at load
    from conformance.quant_refs_gguf import TYPES
    assert {p.id for p in both} == {f"unquantized-{case}-cpu-{d}-tp"
                                    for case in ("dense", *(f"gguf-{t.lower()}" for t in TYPES))
                                    for d in ("bfloat16", "float16", "float32")}
    assert none[0].marks[0].kwargs["reason"] == \
        "w8a8_int8 does not declare QuantCaps.tensor_parallel"
