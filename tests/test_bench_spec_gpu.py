"""bench/bench_spec_gpu.py: the bench-only oracle proposer, the arguments, and the script's CPU
mode run as a user runs it (a subprocess: it registers the oracle for its own engines only, so
this process's plugin registry never sees it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


def _load(name: str):
    """bench/<name>.py as module `name` (registered first: its dataclasses look it up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def oracle():
    return _load("spec_oracle")


@pytest.fixture(scope="module")
def bench():
    return _load("bench_spec_gpu")


def test_oracle_replays_the_recording_and_stops_where_the_request_departs(oracle):
    from core.contract.spec import DraftRequest, SpecConfig

    prompt, out = [5, 6, 7], [10, 11, 12, 13, 14, 15]
    p = oracle.OracleProposer(SpecConfig(num_draft_tokens=4, vocab_size=100),
                              {tuple(prompt): out})

    def ask(rid: str, tokens: list[int], k: int = 4) -> list[int]:
        return p.propose([DraftRequest(rid, tokens, len(prompt), k)])[0]

    assert ask("a", prompt + out[:1]) == out[1:5]
    assert ask("a", prompt + out[:3], k=2) == out[3:5]  # the request's bound
    assert ask("a", prompt + out[:5]) == out[5:]  # the end of the recording
    assert ask("a", prompt + out) == []
    assert ask("b", [9, 9, 9, 1]) == []  # a prompt not recorded
    assert ask("c", prompt + [10, 99]) == []  # departed: nothing more, ever
    assert ask("c", prompt + [10, 99, 12]) == []
    p.reset("c")  # retracted and back: checked again from its first output token
    assert ask("c", prompt + out[:2]) == out[2:6]
    p.observe("a", 4, 4)
    p.reset("unknown")
    assert any("BENCH ONLY" in n for n in p.notes())


def test_oracle_needs_its_recording(oracle, monkeypatch, tmp_path):
    from core.contract.spec import SpecConfig

    monkeypatch.delenv(oracle.FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="not for serving"):
        oracle.OracleProposer(SpecConfig())
    path = tmp_path / "rec.json"
    oracle.write_recording(path, [([1, 2], [3, 4, 5])])
    monkeypatch.setenv(oracle.FILE_ENV, str(path))
    p = oracle.OracleProposer(SpecConfig(num_draft_tokens=2))
    assert p.recording == {(1, 2): [3, 4, 5]}


def test_arguments(bench):
    a = bench.parse_args([])
    assert a.device == "cuda" and a.dtype == "float32" and a.cfg["hidden_size"] == 4096
    assert a.cases == list(bench.CASES) and a.num_prompts == bench.DEFAULT_PROMPTS["cuda"]
    assert (a.input_len, a.output_len, a.draft_tokens, a.draft_quantization) == \
        (256, 256, 4, "fp8")
    c = bench.parse_args(["--device", "cpu", "--cases", "b1, c64", "--num-prompts",
                          "b1=3,c64=128"])
    assert c.dtype == "float32" and c.cfg["num_hidden_layers"] == 2
    assert c.cases == ["b1", "c64"] and c.num_prompts["b1"] == 3 and c.num_prompts["c64"] == 128
    for bad in (["--cases", "b2"], ["--num-prompts", "b16=8"], ["--num-prompts", "c64=100"],
                ["--num-prompts", "x=1"], ["--output-len", "1"], ["--engine-extra", "{"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_ideal_tokens_per_verify_step(bench):
    # the last token of a request is always the target's: min(k, left - 1) drafts a step
    assert bench.ideal_tokens_per_verify_step(256, 4) == 5.0
    assert bench.ideal_tokens_per_verify_step(32, 4) == 5.0  # 6 steps of 5, one plain step
    assert bench.ideal_tokens_per_verify_step(64, 4) == pytest.approx(63 / 13)
    assert bench.ideal_tokens_per_verify_step(2, 4) is None  # one plain step only


OUT_LEN = 16


@pytest.mark.slow  # ~17-34 s: two engines; the oracle's own logic stays in CI's set (above)
def test_cpu_mode_oracle_forces_acceptance_and_keeps_outputs(tmp_path):
    """Two tiny engines (off, oracle): b1 and b16 greedy outputs identical to speculation off,
    every draft accepted, k + 1 tokens per verify step (but for a request's last steps)."""
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(BENCH / "bench_spec_gpu.py"), "--device", "cpu",
           "--cases", "b1,b16", "--num-prompts", "b1=2,b16=16", "--input-len", "16",
           "--output-len", str(OUT_LEN), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["mismatches"] == [] and report["failed_stages"] == []
    assert "| b1 (" in report["table"] and "| b16 (" in report["table"]
    ideal = (OUT_LEN - 1) / 3  # 4 + 1, 4 + 1, 4 + 1 tokens: three verify steps a request
    for name, n in (("b1", 2), ("b16", 16)):
        f = report["figures"][name]
        assert f["spec"]["requests"] == f["off"]["requests"] == n
        assert f["spec"]["tokens"] == n * OUT_LEN
        # forced acceptance: the oracle replays run 1's greedy outputs, which verification
        # reproduces exactly (fp32 on the CPU)
        assert f["drafted"] > 0 and f["acceptance"] == 1.0
        assert f["tokens_per_verify_step"] > 1
        assert f["tokens_per_verify_step"] == pytest.approx(ideal)
        assert f["ideal_tokens_per_verify_step"] == pytest.approx(ideal)
        c = f["engine_counters"]
        assert c["spec_num_accepted_tokens"] == c["spec_num_draft_tokens"] == f["drafted"]
        assert c["forward_count"]["verify"] > 0
        assert f["tok_s_off"] > 0 and f["tok_s_spec"] > 0 and f["ratio"] > 0
    assert report["runs"]["oracle"]["spec_proposer"] == "bench_oracle"
    assert report["runs"]["off"]["spec_proposer"] is None


def test_verify_cost_times_plain_and_verify_steps_of_the_running_batch(tmp_path):
    """bench/verify_cost.py (profile_decode.py --verify K): on a tiny Llama with speculation on,
    `steps` plain steps (no drafts) then `steps` verify steps (K random drafts a request), each
    kind counted by the runner's forwards, the random drafts left as the proposer found them."""
    from model_fixtures import write_tiny_llama

    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    verify_cost = _load("verify_cost")
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(write_tiny_llama(tmp_path)), dtype="float32", max_total_tokens=2048,
        speculative_algorithm="ngram", speculative_num_draft_tokens=3,
        speculative_governor="off"))
    sched = build_engine_core(args, plan, spec, registry).scheduler
    for i in range(2):
        sched.add_request(f"r{i}", list(range(10 + i, 30 + i)),
                          {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40})
    while len(sched.running) < 2:
        sched.step()
    propose = sched.spec.proposer.propose
    got = verify_cost.verify_vs_plain(sched, 3, 4)
    assert sched.spec.proposer.propose == propose
    assert got["plain_forwards"] == {"decode": 4}
    # CPU graphs: each verify step replays them as decode rows (cpu_c declares verify_rows)
    assert got["verify_forwards"] == {"verify": 4, "verify_graph": 4}
    assert got["plain_step_ms"] > 0 and got["verify_step_ms"] > 0
    assert got["best_case_spec_vs_off"] == pytest.approx(4 / got["verify_vs_plain"])
    assert sched.counters["spec_num_draft_tokens"] == 4 * 2 * 3
    sched.check_accounting()
