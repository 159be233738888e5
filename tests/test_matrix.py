"""`core matrix` (core/plan/matrix.py): the support matrix generated from the declarations, and
docs/SUPPORT.md, the built-in plugins' matrix, which must match its regeneration.

The installed example package's rows (a real pip install) are tested in tests/test_examples.py,
beside the other tests of that package.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from pathlib import Path

import pytest

from core.cli import main
from core.contract.capabilities import KINDS, AttentionCaps, PageSizes, QuantCaps
from core.contract.hookspecs import hookimpl
from core.plan import matrix
from core.plan.quant_scheme import FORMATS, parse_quant_config
from core.plan.registry import Registry, build_registry

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / matrix.SUPPORT_DOC


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The installed plugins (entry points), as `core matrix` finds them."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY"):
            mp.delenv(name, raising=False)
        return build_registry()


@pytest.fixture(scope="module")
def builtin(registry) -> Registry:
    return matrix.only(registry, matrix.BUILTIN_DIST)


def _section(doc: str, heading: str) -> str:
    """The text under `## heading`, up to the next `## `."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", doc, re.S | re.M)
    assert m, f"no section {heading!r}"
    return m.group(1)


def _row(section: str, name: str) -> list[str]:
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in\n{section}")


# --------------------------------------------------------------------------- docs/SUPPORT.md

def test_support_doc_matches_its_regeneration(registry, monkeypatch):
    # what the environment says of this machine is not read
    monkeypatch.setenv("CORE_DISABLE_FUSED_OPS", "1")
    fresh = matrix.support_doc(registry)
    committed = DOC.read_text() if DOC.is_file() else ""
    if fresh != committed:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(True), fresh.splitlines(True), "docs/SUPPORT.md (committed)",
            "regenerated"))[:60])
        pytest.fail(f"{matrix.SUPPORT_DOC} is stale: regenerate it with\n\n    "
                    f"{matrix.REGENERATE}\n\nfrom the repository root, and commit it.\n{diff}",
                    pytrace=False)


def test_support_doc_covers_every_kind_and_every_builtin_plugin(builtin):
    doc = DOC.read_text()
    for kind in KINDS:
        section = _section(doc, kind)
        regs = builtin.kind(kind)
        assert regs, f"no built-in {kind} plugin"
        for name in regs:
            _row(section, name)
    assert "## Plugins that failed to load" not in doc
    # no version: the doc does not change with every release
    assert not re.search(r"core-serve \d", doc)
    # every built-in profile, every family, every weight format core parses
    plans = _section(doc, "Plans")
    from core.plan.devices import PROFILES

    for profile in PROFILES:
        assert f"\n| {profile} |" in plans
    for family, config in matrix.FAMILIES:
        assert f"### {family}: " in plans and config in plans
    for fmt in FORMATS[1:]:
        assert f"#### dense: {fmt} checkpoint" in plans


def test_the_readme_links_the_support_doc():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/SUPPORT.md)" in readme


# ----------------------------------------------------------------------------------- tables

def test_cells_say_any_where_the_declaration_does(builtin):
    doc = matrix.document(builtin, kind="attention", dist=matrix.BUILTIN_DIST)
    header = _row(doc, "name")
    torch_native = dict(zip(header, _row(doc, "torch_native"), strict=True))
    assert torch_native["head_sizes"] == "any"  # head_sizes=None
    assert torch_native["page_sizes"] == "any"  # PageSizes.any()
    assert torch_native["phases"] == "any"  # both phases of the contract
    assert torch_native["dtypes"] == "any"  # every compute dtype
    triton = dict(zip(header, _row(doc, "triton"), strict=True))
    assert triton["devices"] == "cuda (sm80+), rocm"
    assert triton["head_sizes"] == "32, 64, 80, 96, 128, 256"
    assert triton["needs"] == "triton"
    assert "cuda_graph" in triton["flags"].split(", ")
    avx2 = dict(zip(header, _row(doc, "cpu_c_avx2"), strict=True))
    assert avx2["devices"] == "cpu (avx2+f16c+fma)"
    assert avx2["needs"] == "cc (program)"
    ops = matrix.document(builtin, kind="layer_ops", dist=matrix.BUILTIN_DIST)
    assert dict(zip(_row(ops, "name"), _row(ops, "torch"), strict=True))["devices"] == "any"
    # one table only, no distribution column with --only
    assert doc.count("\n## ") == 1 and "distribution" not in header


def test_a_declaration_change_moves_the_table_and_the_plans(builtin):
    entries = {k: dict(v) for k, v in builtin.entries.items()}
    reg = entries["attention"]["triton"]
    caps = dataclasses.replace(reg.caps, head_sizes=frozenset({64}), priority={"cuda": 0})
    entries["attention"]["triton"] = dataclasses.replace(reg, caps=caps)
    changed = Registry(entries=entries, plugins=list(builtin.plugins))
    doc = matrix.document(changed, kind="attention", dist=matrix.BUILTIN_DIST)
    assert dict(zip(_row(doc, "name"), _row(doc, "triton"), strict=True))["head_sizes"] == "64"
    models = matrix.load_models()[:1]
    variants = matrix.weights_variants(changed)[:1]
    before = matrix.plan_rows(matrix.assume_installed(builtin), models, ["h100"], variants)
    after = matrix.plan_rows(matrix.assume_installed(changed), models, ["h100"], variants)
    assert before[0].plan.decode_attention == "triton"
    # Llama's head dim 128 is no longer declared: the next fitting backend is chosen
    assert after[0].plan.decode_attention == "flex_attention"


def test_json_gives_the_capability_dataclasses(builtin):
    data = json.loads(matrix.document(builtin, dist=matrix.BUILTIN_DIST, as_json=True))
    assert list(data["kinds"]) == list(KINDS) and data["only"] == "core-serve"
    rows = {r["name"]: r for r in data["kinds"]["attention"]}
    reg = builtin.get("attention", "triton")
    assert rows["triton"]["caps"] == matrix.jsonable(reg.caps)
    assert rows["triton"]["caps"]["page_sizes"] == {"mode": "any", "values": []}
    assert rows["triton"]["caps"]["capability"] == {"cuda": {"min": 80, "max": None,
                                                             "archs": None}}
    assert rows["triton"]["distribution"] == "core-serve" and rows["triton"]["version"]
    assert "plans" not in data


class _Broken:
    @hookimpl
    def core_register_attention_backends(self, register):
        raise RuntimeError("this plugin is broken on purpose")


class _Extra:
    """A third party's declarations, in-process: an attention backend, a quant method with a
    checkpoint format of its own and a quantization at load."""

    @hookimpl
    def core_register_attention_backends(self, register):
        register("extra_attn", AttentionCaps(
            devices={"cuda"}, head_sizes={128}, page_sizes=PageSizes.of(64),
            requires=("core_test_missing_kernel_pkg",), priority={"cuda": 1000}), "x:y")

    @hookimpl
    def core_register_quant_methods(self, register):
        register("extra_quant", QuantCaps(
            devices={"cuda"}, config_names={"extra_fmt"}, formats={"extra_fmt", "extra_q4"},
            online_format="extra_q4", online_activations="none", weight_bits={4},
            priority={"cuda": 1000}), "x:y")


def test_plugins_outside_the_entry_points_and_failures_are_listed(clean_plugin_env):
    registry = build_registry(extra=[("extra", _Extra()), ("broken", _Broken())],
                              entry_points=False)
    doc = matrix.document(registry)
    row = _row(_section(doc, "attention"), "extra_attn")
    assert row[1] == "`<in-process> (extra)`"
    assert row[2] == "cuda" and "core_test_missing_kernel_pkg" in row
    failed = _section(doc, "Plugins that failed to load")
    assert "broken" in failed and "this plugin is broken on purpose" in failed
    data = json.loads(matrix.document(registry, as_json=True))
    assert data["failures"][0]["stage"] == "register"
    assert "this plugin is broken on purpose" in data["failures"][0]["error"]


def test_plans_take_a_plugins_own_formats_and_assume_its_packages(registry, clean_plugin_env):
    extra = build_registry(extra=[("extra", _Extra())], entry_points=False)
    merged = Registry(entries={k: {**registry.kind(k), **extra.kind(k)} for k in KINDS},
                      plugins=registry.plugins + extra.plugins)
    labels = [w.label for w in matrix.weights_variants(merged)]
    assert "extra_fmt checkpoint (quant_method extra_fmt)" in labels
    assert "unquantized, --quantization extra_quant (extra_q4 at load)" in labels
    rows = matrix.plan_rows(matrix.assume_installed(merged), matrix.load_models()[:1], ["h100"],
                            [w for w in matrix.weights_variants(merged) if "extra" in w.label])
    assert [r.plan.quant_method for r in rows] == ["extra_quant", "extra_quant"]
    # its package is missing here, but plans describe no machine in particular; page size 64
    # is adopted as with any other backend
    assert {(r.plan.decode_attention, r.plan.page_size) for r in rows} == {("extra_attn", 64)}
    here = matrix.plan_rows(merged, matrix.load_models()[:1], ["h100"],
                            [matrix.Weights("unquantized")])
    assert here[0].plan.decode_attention != "extra_attn"


def test_every_weight_format_has_one_checkpoint_example():
    formats = [parse_quant_config(q).format for q in matrix.CHECKPOINTS]
    assert sorted(formats) == sorted(FORMATS[1:])


# ------------------------------------------------------------------------------------ plans

def _resolve_json(capsys, config: Path, profile: str, flags: list[str]) -> dict:
    code = main(["resolve", "--model-path", str(config), "--device-profile", profile,
                 "--tool-call-parser", "none", "--json", *flags])
    out = json.loads(capsys.readouterr().out)
    return {"code": code, **out}


@pytest.mark.parametrize("label, profile", [
    ("unquantized", "t4"), ("unquantized, --dtype bfloat16", "t4"),
    ("fp8_block checkpoint (quant_method fp8)", "h100"),
    ("fp8_block checkpoint (quant_method fp8)", "a100"),
    ("unquantized, --kv-cache-dtype fp8_e4m3", "xeon-amx"),
    ("unquantized, --quantization w8a8_int8 (int8_channel at load)", "x86-cpu"),
])
@pytest.mark.parametrize("family", [0, 1])
def test_a_plan_is_what_core_resolve_says(label, profile, family, registry, tmp_path, capsys,
                                          clean_plugin_env, monkeypatch):
    """The matrix's row and `core resolve` on the same config and flags agree, both on this
    machine's packages (the registry as found, not assume_installed)."""
    from core.plan import registry as plugins

    monkeypatch.setattr(plugins, "_cached", registry)
    monkeypatch.setattr(plugins, "_extra", [])
    model = matrix.load_models()[family]
    weights = next(w for w in matrix.weights_variants(registry) if w.label == label)
    (row,) = matrix.plan_rows(registry, [model], [profile], [weights])
    config = dict(model.config)
    if weights.quantization_config is not None:
        config["quantization_config"] = dict(weights.quantization_config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = _resolve_json(capsys, path, profile, weights.flags())
    if row.plan is None:
        assert out["code"] == 1 and out["error"] == row.error.args[0]
        assert out["reasons"] == row.error.reasons
    else:
        assert out["code"] == 0
        assert {f: out["plan"][f] for f in matrix.PLAN_FIELDS} == \
            {f: getattr(row.plan, f) for f in matrix.PLAN_FIELDS}


def test_plans_json_and_markdown(builtin):
    models = matrix.load_models()
    variants = matrix.weights_variants(builtin)
    rows = matrix.plan_rows(matrix.assume_installed(builtin), models, ["h100", "t4"], variants)
    data = matrix.plans_json(rows, ["h100", "t4"])
    assert len(data["rows"]) == len(models) * len(variants) * 2
    by = {(r["family"], r["weights"], r["device_profile"]): r for r in data["rows"]}
    dense = by[("dense", "unquantized", "h100")]
    assert dense["plan"]["decode_attention"] == "triton" and dense["refused"] is None
    refused = by[("MoE", "int4_awq checkpoint (quant_method awq)", "h100")]
    assert refused["plan"] is None
    assert refused["refused"]["first_reason"].endswith("awq: cannot quantize MoE expert weights")
    # the resolver gives the reasons of the methods that load the format first
    fp8 = by[("dense", "fp8_block checkpoint (quant_method fp8)", "t4")]["refused"]
    assert fp8["first_reason"].endswith("fp8: needs CUDA sm89+ (device is sm75)")
    assert data["profiles"]["t4"]["capability"] == 75
    text = "\n".join(matrix.plans_markdown(rows, ["h100", "t4"]))
    section = text.split("#### MoE: int4_awq checkpoint")[1]
    assert "| h100 | - |" in section and "cannot quantize MoE expert weights" in section


# -------------------------------------------------------------------------------------- CLI

def test_cli_kind_only_and_usage_errors(capsys):
    assert main(["matrix", "--kind", "tool_parser", "--only", "core-serve"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Support matrix") and "## tool_parser" in out
    assert out.count("\n## ") == 1 and "| hermes |" in out
    assert main(["matrix", "--only", "no-such-dist"]) == 2
    assert "no plugin of that distribution" in capsys.readouterr().err
    assert main(["matrix", "--model-path", "x.json"]) == 2
    assert "add --plans" in capsys.readouterr().err
    assert main(["matrix", "--plans", "--device-profile", "nope"]) == 2
    assert "unknown device profile 'nope'" in capsys.readouterr().err
    assert main(["matrix", "--kind", "nope"]) == 2


def test_cli_plans_for_a_given_model_and_profile(capsys, tmp_path):
    config = ROOT / "tests" / "fixtures" / "configs" / "mixtral-8x7b.json"
    assert main(["matrix", "--plans", "--json", "--only", "core-serve", "--kind", "moe",
                 "--model-path", str(config), "--device-profile", "l4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["kinds"]) == ["moe"]
    assert {r["device_profile"] for r in data["plans"]["rows"]} == {"l4"}
    assert {r["family"] for r in data["plans"]["rows"]} == {"MoE"}
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert main(["matrix", "--plans", "--model-path", str(gguf)]) == 2
    assert "plans start from a config.json" in capsys.readouterr().err
