"""bench/bench_lora_serving.py's --device cpu mode at tiny sizes: a base engine and a LoRA
engine on a tiny random Llama with random rank-16 adapters. Checks what its report claims:
every request got its tokens, the adapters' greedy tokens differ from the base model's (the
delta is applied), the LoRA engine's base requests equal the base engine's (fp32), and the
ratios against the base are there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import bench_lora_serving  # noqa: E402

N_ADAPTERS, OUT = 4, 4


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, int]:
    out = tmp_path_factory.mktemp("bench_lora_serving") / "lora.json"
    rc = bench_lora_serving.main(
        ["--device", "cpu", "--num-adapters", str(N_ADAPTERS), "--input-len", "8",
         "--output-len", str(OUT), "--batch1-requests", "2", "--concurrent", str(N_ADAPTERS),
         "--out", str(out)])
    return json.loads(out.read_text()), rc


def test_adapter_requests_differ_from_base_and_base_requests_do_not(report):
    rep, rc = report
    assert rc == 0, rep.get("checks")
    assert rep["failed_stages"] == [] and rep["checks"]["failed"] == []
    checks = rep["checks"]
    assert checks["batch1_adapter_requests_differing_from_base"] == "2/2"
    assert checks["concurrent_adapter_requests_differing_from_base"] == \
        f"{N_ADAPTERS}/{N_ADAPTERS}"
    # fp32 on a CPU: enabling LoRA leaves base requests' tokens exactly as they were
    assert checks["batch1_lora_engine_base_requests_equal_to_base"] == "2/2"
    assert checks["concurrent_lora_engine_base_requests_equal_to_base"] == \
        f"{N_ADAPTERS}/{N_ADAPTERS}"


def test_report_has_the_runs_and_ratios(report):
    rep, _ = report
    base, lora = rep["base"], rep["lora"]
    assert lora["lora_backend"] == "torch_native"  # the resolver's choice on a CPU
    assert base["lora_backend"] is None
    # CPU graphs for the base; torch_native LoRA is not graph safe, so the LoRA engine has
    # none, and the base without graphs is measured beside them
    assert base["cuda_graph"] and not lora["cuda_graph"]
    eager = rep["base_eager"]
    assert not eager["cuda_graph"] and eager["batch1_base"]["graph_replays"] == 0
    assert lora["lora_slot_loads"] == N_ADAPTERS  # every adapter into its own slot, once
    for eng, kinds in ((base, ("base",)), (lora, ("base", "lora"))):
        for kind in kinds:
            b1, conc = eng[f"batch1_{kind}"], eng[f"concurrent_{kind}"]
            assert b1["requests"] == 2 and conc["requests"] == N_ADAPTERS
            assert b1["output_tokens"] == 2 * OUT and conc["output_tokens"] == N_ADAPTERS * OUT
            assert b1["decode_tok_s"] > 0 and conc["output_tok_s"] > 0
            assert b1["decode_steps"] == 2 * (OUT - 1)
            assert b1["graph_replays"] == (b1["decode_steps"] if eng is base else 0)
            assert "tokens" not in b1  # per-request tokens are compared, not kept
    s = rep["summary"]
    for key in ("batch1_decode_tok_s_lora_lora_vs_base", "batch1_decode_tok_s_lora_base_vs_base",
                "concurrent_output_tok_s_lora_lora_vs_base",
                "concurrent_output_tok_s_lora_base_vs_base"):
        assert s[key] is not None and s[key] > 0, key
    assert s["batch1_target"] == 0.85 and s["concurrent_target"] == 0.8
    assert isinstance(s["batch1_meets_target"], bool)


def test_table_names_the_cases(report, capsys):
    rep, _ = report
    a = bench_lora_serving.parse_args(["--device", "cpu", "--num-adapters", str(N_ADAPTERS),
                                       "--concurrent", str(N_ADAPTERS)])
    text = bench_lora_serving.table(rep, a)
    assert "LoRA backend torch_native" in text
    assert f"| batch 1 | LoRA on, {N_ADAPTERS} adapters | 2 |" in text
    assert f"| {N_ADAPTERS} concurrent | LoRA on, base requests |" in text
    assert ">= 0.8 (" in text and ">= 0.85 (" in text
