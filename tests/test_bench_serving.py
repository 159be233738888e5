"""bench/bench_serving.py's cpu scenario, online and shared-prefix modes, at tiny sizes.

Runs the script as a user would (a subprocess: it starts engines and a `core serve` of its own)
and checks what its report claims: every request completed with the tokens asked for, TTFT never
after the end of its request, the server stopped cleanly, and the prefix cache hit with the radix
cache on and never with it off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
ONLINE_N, ONLINE_IN, ONLINE_OUT = 4, 32, 6
SP_N, SP_PREFIX, SP_SUFFIX, SP_OUT = 4, 64, 4, 4


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_serving") / "serving.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_serving.py"), "--scenario", "cpu",
           "--modes", "online,shared-prefix", "--per-request", "--out", str(out),
           "--online-num-prompts", str(ONLINE_N), "--online-input-len", str(ONLINE_IN),
           "--online-output-len", str(ONLINE_OUT), "--request-rate", "inf",
           "--max-concurrency", "3", "--online-warmup", "1",
           "--shared-prefix-len", str(SP_PREFIX), "--shared-prefix-num-requests", str(SP_N),
           "--shared-prefix-suffix-len", str(SP_SUFFIX), "--shared-prefix-output-len",
           str(SP_OUT)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "summary (cpu, cpu scenario" in proc.stdout
    return json.loads(out.read_text())


def test_online_requests_complete_with_the_tokens_asked(report):
    on = report["online"]
    assert report["failed_stages"] == []
    assert on["completed"] == ONLINE_N and on["failed"] == 0, on["errors"]
    assert on["total_input_tokens"] == ONLINE_N * ONLINE_IN
    assert on["total_output_tokens"] == ONLINE_N * ONLINE_OUT
    assert len(on["per_request"]) == ONLINE_N
    for r in on["per_request"]:
        assert r["ok"] and r["error"] is None
        assert r["prompt_tokens"] == ONLINE_IN and r["output_tokens"] == ONLINE_OUT
        assert 1 <= r["chunks"] <= ONLINE_OUT  # streamed, not one answer at the end
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    for k in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < on[f"{k}_median_ms"] <= on[f"{k}_p99_ms"]
    assert on["ttft_median_ms"] <= on["e2e_median_ms"]
    assert on["duration_s"] > 0 and on["output_tok_s"] > 0 and on["request_throughput"] > 0
    assert on["server_exit_code"] == 0  # SIGTERM: drained and stopped by itself


def test_shared_prefix_hits_the_cache_only_with_radix_on(report):
    sp = report["shared_prefix"]
    on, off = sp["radix_on"], sp["radix_off"]
    for run in (on, off):
        assert run["requests"] == SP_N
        assert run["output_tokens_min"] == run["output_tokens_max"] == SP_OUT
        assert run["input_tokens"] == SP_N * (SP_PREFIX + SP_SUFFIX)
        for r in run["per_request"]:
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    # the warm-up put the prefix in the cache; suffixes differ from their first token on
    assert on["cached_tokens_total"] > 0
    assert [r["cached_tokens"] for r in on["per_request"]] == [SP_PREFIX] * SP_N
    assert on["engine_cached_tokens"] == SP_N * SP_PREFIX
    assert off["cached_tokens_total"] == 0 and off["engine_cached_tokens"] == 0
    assert all(r["cached_tokens"] == 0 for r in off["per_request"])
    assert on["engine_prefill_tokens"] < off["engine_prefill_tokens"]
    assert sp["ratio"] is not None and sp["ratio"] > 0


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving_for_tests",
                                                  REPO / "bench" / "bench_serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # puts bench/ on sys.path (its siblings import from there)
    return mod


def test_variants_parse_and_report_beside_offline():
    bs = _bench_module()
    a = bs.parse_args(["--scenario", "cpu", "--online-variants", "off=--decode-itl-target-ms 0",
                       "on=--decode-itl-target-ms 50", "--offline-variants",
                       'budget-off={"decode_itl_target_ms": 0}'])
    assert a.online_variants == {"off": "--decode-itl-target-ms 0",
                                 "on": "--decode-itl-target-ms 50"}
    assert a.offline_variants == {"budget-off": {"decode_itl_target_ms": 0}}
    for bad in (["--online-variants", "noequals"], ["--online-variants", "a=x", "a=y"],
                ["--offline-variants", "x=notjson"], ["--offline-variants", "x=[1]"]):
        with pytest.raises(SystemExit):
            bs.parse_args(["--scenario", "cpu", *bad])
    from serving_report import summarize, summary_table

    online = {"num_prompts": 600, "input_len": 1024, "output_len": 256, "request_rate": "inf",
              "max_concurrency": 256, "completed": 600, "failed": 0, "output_tok_s": 5700.0,
              "ttft_p99_ms": 6000.0, "itl_median_ms": 40.0, "itl_p99_ms": 90.0,
              "engine_stats": {"prefill_budget_target_ms": 50.0, "prefill_budget_tokens": 1408,
                               "prefill_capped_steps": 321}}
    offline = {"output_tok_s": 6000.0, "requests": 1000, "input_len": 1024, "output_len": 256,
               "request_throughput": 23.4, "input_tok_s": 24000.0, "wall_s": 42.7}
    report = {"engine_graphs": {"offline": offline},
              "offline_variants": {"budget-off": {"offline": {"output_tok_s": 5900.0,
                                                              "requests": 1000},
                                                  "prefill_capped_steps": 0}},
              "online_variants": {"on": online, "off": {"error": "RuntimeError: boom"}},
              "device": "H200", "args": {"scenario": "gpu"}, "stage_wall_s": {}}
    report["summary"] = s = summarize(report)
    assert s["online[on]"]["vs_offline"] == 0.95
    assert s["online[on]"]["prefill_capped_steps"] == 321
    assert s["offline[budget-off]_vs_offline"] == pytest.approx(0.983)
    table = summary_table(report)
    assert "online[on]" in table and "50.0 | 1408 | 321" in table
    assert "online[off]" in table and "FAILED" in table
