"""bench/bench_spec_cpu.py without running an engine: arguments, the prompt sets, the report.

The benchmark itself (minutes at one thread, llama_cpp optional) is run by hand; this checks
what it is built from, in about a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "bench" / "bench_spec_cpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_spec_cpu", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(bench):
    a = bench.parse_args([])
    assert a.configs == list(bench.DEFAULT_CONFIGS) and a.sets == list(bench.SETS)
    assert a.max_new_tokens == 160 and a.draft_tokens == 4 and a.threads == 1
    assert a.llama_pred_tokens == [2, 10] and a.llama_extra_bufts == "off"
    q = bench.parse_args(["--quick", "--configs", "ours:off, ours:standalone",
                          "--llama-pred-tokens", "3", "--sets", "open_ended"])
    assert q.max_new_tokens == 32 and q.configs == ["ours:off", "ours:standalone"]
    assert q.llama_pred_tokens == [3] and q.sets == ["open_ended"]
    for bad in (["--configs", "vllm:ngram"], ["--configs", ","], ["--sets", "code"],
                ["--threads", "0"], ["--max-new-tokens", "0"], ["--llama-pred-tokens", "x"],
                ["--llama-pred-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_prompt_sets_are_whole(bench):
    bench.check_sets()  # unique names, chat turns ending with the user's
    assert set(bench.SETS) == {"input_grounded", "open_ended"}
    assert 8 <= len(bench.SETS["input_grounded"]) <= 12
    assert 8 <= len(bench.SETS["open_ended"]) <= 12
    quick = bench.select(bench.SETS, ["input_grounded"], quick=True)
    assert list(quick) == ["input_grounded"] and len(quick["input_grounded"]) == 2
    for broken in ({"s": []},
                   {"s": [{"name": "a", "messages": [{"role": "user", "content": "x"}]}] * 2},
                   {"s": [{"name": "a", "messages": [{"role": "user", "content": " "}]}]},
                   {"s": [{"name": "a", "messages": [{"role": "assistant", "content": "x"}]}]}):
        with pytest.raises(ValueError):
            bench.check_sets(broken)


def _req(name, ids, decode_s, **kw):
    return {"name": name, "output_ids": ids, "ttft_s": 0.1, "decode_s": decode_s,
            "total_s": 0.1 + decode_s, **kw}


def test_figures_table_targets_and_mismatches(bench):
    spec = {"spec_verify_ct": 5, "spec_draft_tokens": 20, "spec_accepted_tokens": 15}
    off = {"input_grounded": [_req("a", list(range(21)), 1.0, worker_cpu_s=1.05,
                                   decode_cpu_s=0.8)],
           "open_ended": [_req("b", [1] * 11, 1.0, worker_cpu_s=0.55)]}
    report = {"results": {
        "ours:off": {"sets": off},
        "ours:ngram": {"sets": {
            "input_grounded": [_req("a", list(range(21)), 0.5, worker_cpu_s=0.6,
                                    decode_cpu_s=0.5, **spec)],
            "open_ended": [_req("b", [1] * 10 + [2], 1.0, spec_verify_ct=2,
                                spec_draft_tokens=4, spec_accepted_tokens=0)]}},
        "llama.cpp:off": {"runs": {"0": {"sets": off}}},
        "llama.cpp:lookup": {"runs": {
            "2": {"sets": {"input_grounded": [_req("a", list(range(21)), 0.8)],
                           "open_ended": [_req("b", [1] * 11, 1.0)]}},
            "10": {"sets": {"input_grounded": [_req("a", list(range(21)), 0.4)],
                            "open_ended": [_req("b", [1] * 11, 2.0)]}}}}}}
    fig = bench.figures(report)
    g, o = fig["input_grounded"], fig["open_ended"]
    assert g["ours:off"]["decode_tok_s"] == pytest.approx(20.0)
    assert g["ours:off"]["worker_cpu_ms_per_tok"] == pytest.approx(50.0)
    assert g["ours:ngram"]["decode_tok_s"] == pytest.approx(40.0)
    assert g["ours:ngram"]["acceptance"] == pytest.approx(0.75)
    assert g["ours:ngram"]["mean_accepted_len"] == pytest.approx(3.0)
    # the profile: no plain step, 5 verify steps in 0.5 s against 0.05 s per plain step
    assert g["ours:ngram"]["plain_steps"] == 0
    assert g["ours:ngram"]["verify_step_vs_plain"] == pytest.approx(2.0)
    assert g["ours:ngram"]["tokens_per_verify_step"] == pytest.approx(4.0)
    assert g["llama.cpp:lookup"]["num_pred_tokens"] == 10  # the best per set
    assert o["llama.cpp:lookup"]["num_pred_tokens"] == 2
    assert "llama.cpp:off/0" not in g and g["llama.cpp:off"]["decode_tok_s"] == 20.0
    table = bench.markdown_table(fig).splitlines()
    assert table[0].startswith("| set | ours off | ngram | suffix | ngram / off |")
    assert table[2].startswith("| input_grounded | 20.0 | 40.0 | - | 2.00x | - | 0.75 / - |")
    assert table[2].endswith("| 20.0 | 50.0 (10) | 2.50x | 0.80x | 1.60x, - |")
    assert g["ours:off"]["decode_tok_per_cpu_s"] == pytest.approx(25.0)  # CPU, not wall
    assert "decode_tok_per_cpu_s" not in o["ours:off"]
    t = bench.targets(fig)
    assert "input_grounded ngram / off = 2.00x (target >= 1.8x): met" in t
    assert "input_grounded ngram / llama.cpp lookup = 0.80x (target >= 1.5x): missed" in t
    assert "open_ended ngram / off = 1.00x (target >= 0.95x): met" in t
    assert bench.mismatches(report) == [
        "ours:ngram open_ended/b: differs from ours:off at token 10 (11 vs 11 tokens)"]
    assert "llama.cpp:off input_grounded: 1/1 answers identical to ours:off" in \
        bench.agreement(report)
    assert "| open_ended | ours:ngram | 11 |" in bench.detail_table(fig)


def test_finish_rebuilds_the_report(bench, tmp_path, capsys):
    """--from-json: the tables and the greedy check from a saved report's raw results."""
    req = _req("a", [1, 2, 3], 0.1, worker_cpu_s=0.2)
    report = {"date": "d", "machine": {"model_name": "cpu", "isa": ["avx2"], "loadavg_1m": 1.0},
              "loadavg_1m_end": 1.0, "workload": {"threads": 1, "max_new_tokens": 3,
                                                  "draft_tokens": 4},
              "stage_wall_s": {"ours:off": 1.0, "ours:ngram": 1.0},
              "foreign_cpu_s": {"ours:off": 0.0, "ours:ngram": 0.5},
              "results": {"ours:off": {"sets": {"open_ended": [req]}},
                          "ours:ngram": {"sets": {"open_ended": [req]}}}}
    out = tmp_path / "r.json"
    out.write_text(__import__("json").dumps(report))
    assert bench.main(["--from-json", str(out), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| open_ended | 20.0 | 20.0 |" in printed
    assert "ours:ngram: other processes took 0 CPU-s during its 1 s (WARNING" in printed
    report["results"]["ours:ngram"]["sets"]["open_ended"] = [_req("a", [1, 2, 4], 0.1)]
    out.write_text(__import__("json").dumps(report))
    assert bench.main(["--from-json", str(out)]) == 1  # a mismatch fails the run
    assert "GREEDY MISMATCH" in capsys.readouterr().out
