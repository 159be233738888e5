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
