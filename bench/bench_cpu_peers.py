"""The engine on the CPU against llama.cpp and HF transformers: the same GGUF, the same prompts.

    python bench/bench_cpu_peers.py --out peers.json
    python bench/bench_cpu_peers.py --quick --peers ours,llama.cpp          # smoke test
    python bench/bench_cpu_peers.py --dtype float32 --threads 2 --out peers_fp32.json

The model is the default one (SmolLM2-135M-Instruct Q4_1, `core.plan.default_model`). Every peer gets
the same token ids (random in [100, 40000), seeded; no BOS), greedy, EOS ignored:
- decode tg128: tokens/s at batch 1, 128 new tokens after a 16-token prompt, the first token
  excluded (tokens after the first / time from the first to the last);
- prompt pp512 and pp4096: prompt tokens / time to the first token of a 1-token request (the
  prefix cache flushed before each);
- 16 concurrent requests, prompts of 64..512 tokens, 128 new tokens each: total output tokens/s.
  Ours: a `core serve` subprocess, 16 streamed /v1/completions requests at once (token-id
  prompts). llama.cpp: llama-cpp-python serves one sequence at a time, so its figure is the same
  16 requests run one after the other. HF: one left-padded batched `generate` of the 16 prompts;
- TTFT of the 512-token prompt, model load time (constructor, imports excluded; ours includes
  the plan, the tokenizer and the spawned engine worker) and peak RSS (VmHWM; ours: the client
  process + its engine worker).
Each peer runs in its own subprocess (this script with --worker PEER), so load time and peak RSS
are its own. Ours is measured as a user runs it (`core.Engine`, streaming); the table names the
plan's quant method and weight format, i.e. which path ran (`gguf_*`: the blocks kept and
multiplied by the C kernels, the default on a CPU; `unquantized`: dequantized to --dtype at
load, with --quantization unquantized; llama.cpp runs the Q4_1 blocks as stored). Figures are medians of
--reps runs after a warm-up run of the same kind. Ratios are ours / llama.cpp of figures from this
run. CPU time that other processes took during each peer's stage is measured (/proc/stat minus
our own process tree) and a note warns when it is over 10% of the stage. A markdown table is
printed with the CPU, its ISA flags and the versions; all of it goes to --out. --quick shrinks
to tg32, pp128 and 4 concurrent requests of 64..128 tokens, 32 new each.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO), str(REPO / "tests")):  # this checkout; hf_reference
    if _p not in sys.path:
        sys.path.insert(0, _p)

from cli_lists import choice_list  # noqa: E402

PEERS = ("ours", "llama.cpp", "hf")
LABELS = {"ours": "ours", "llama.cpp": "llama.cpp", "hf": "HF"}
ID_RANGE = (100, 40000)
TG_PROMPT = 16
N_CTX = 8192  # llama.cpp's context and ours' KV pool, alike
NOTE_CHARS = 400  # of an error in the printed notes
FOREIGN_WARN = 0.1  # other processes' CPU-s per second of a stage, above which a note warns
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


# -- the workload: one set of token ids for every peer --------------------------------------------

def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"tg_new": 32, "pp_lens": [128], "ttft_len": 128, "concurrent": 4,
                "concurrent_lens": (64, 128), "concurrent_new": 32}
    return {"tg_new": 128, "pp_lens": [512, 4096], "ttft_len": 512, "concurrent": 16,
            "concurrent_lens": (64, 512), "concurrent_new": 128}


def workload(a: argparse.Namespace) -> dict[str, Any]:
    """The job every worker gets: settings and the prompts, as token ids."""
    s = sizes(a.quick)
    if a.pp_lens:  # the prompt lengths asked for, and always the TTFT row's
        s["pp_lens"] = sorted({*(int(n) for n in a.pp_lens.split(",")), s["ttft_len"]})
    rng = random.Random(a.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*ID_RANGE) for _ in range(n)]

    n, (lo, hi) = s["concurrent"], s["concurrent_lens"]
    lens = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    order = [lens[(5 * i) % n] for i in range(n)] if math.gcd(5, n) == 1 else lens  # mixed
    return {**s, "dtype": a.dtype, "threads": a.threads, "reps": a.reps, "seed": a.seed,
            "llama_extra_bufts": a.llama_extra_bufts, "quantization": a.quantization,
            "disable_cuda_graph": a.disable_cuda_graph,
            "n_ctx": N_CTX, "model_path": a.model_path, "hf_concurrent": a.hf_concurrent,
            "warm_prompt": ids(TG_PROMPT), "tg_prompt": ids(TG_PROMPT),
            "pp_prompts": {str(n_): ids(n_) for n_ in s["pp_lens"]},
            "concurrent_prompts": [ids(k) for k in order], "concurrent_prompt_lens": order,
            "serve_warm_prompts": [ids(lo) for _ in range(2)]}


# -- machine facts --------------------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    name, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or "unknown"
    return {"model_name": name, "isa": [f for f in ISA_FLAGS if f in flags],
            "isa_missing": [f for f in ISA_FLAGS if f not in flags],
            "logical_cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident set (VmHWM) of a live process, MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process and its waited-for
    descendants), so far: their difference over a stage is what other processes took."""
    ours = sum(os.times()[:4])
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return math.nan, ours
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK"), ours


def tree_hwm_mb(pid: int) -> float | None:
    """Sum of the peak RSS of a live process and its live descendants, MB."""
    total, stack, seen = 0.0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        total += vm_hwm_mb(p) or 0.0
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stack += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return total or None


# -- workers (each in its own process) ------------------------------------------------------------

def worker_ours(job: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    import torch

    import core
    imported = time.perf_counter() - t
    torch.set_num_threads(job["threads"])  # this process; the engine worker reads OMP_NUM_THREADS
    t = time.perf_counter()
    kw = {"quantization": job["quantization"]} if job.get("quantization") else {}
    if job.get("disable_cuda_graph"):
        kw["disable_cuda_graph"] = True
    engine = core.Engine(job["model_path"], dtype=job["dtype"], device="cpu",
                         max_total_tokens=job["n_ctx"], **kw)
    res: dict[str, Any] = {"import_s": imported, "load_s": time.perf_counter() - t}
    try:
        plan = engine.plan
        res["plan"] = {"quant_method": plan.quant_method, "quant_format": plan.quant_format,
                       "dtype": plan.dtype, "prefill_attention": plan.prefill_attention,
                       "decode_attention": plan.decode_attention, "layer_ops": plan.layer_ops,
                       "kv_cache_dtype": plan.kv_cache_dtype, "notes": list(plan.notes),
                       "engine_notes": list(engine.info.notes)}
        graphs = list(engine.info.cuda_graph_batch_sizes)
        res["path"] = (f"quant {plan.quant_method} (weights {plan.quant_format}, compute "
                       f"{plan.dtype}), {plan.decode_attention} attention, decode graphs "
                       f"{'up to batch ' + str(graphs[-1]) if graphs else 'off'}")

        def stream(ids: list[int], n: int) -> tuple[float, float, int]:
            """(s to the first token, s from the first to the last, tokens after the first)."""
            sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
            t0 = time.perf_counter()
            first = last = None
            count = after = 0
            for chunk in engine.generate(input_ids=ids, sampling_params=sp, stream=True):
                if chunk["token_ids"]:
                    last = time.perf_counter()
                    if first is None:
                        first = last
                    else:
                        after += len(chunk["token_ids"])
                    count += len(chunk["token_ids"])
            if count != n:
                raise RuntimeError(f"asked for {n} tokens, got {count}")
            return first - t0, last - first, after

        stream(job["warm_prompt"], job["tg_new"])  # warm-up: a whole decode run
        rates = []
        for _ in range(job["reps"]):
            _, dt, after = stream(job["tg_prompt"], job["tg_new"])
            rates.append(after / dt)
        res["tg_tok_s"] = statistics.median(rates)
        res["pp_ttft_s"] = {}
        for i, (n, ids) in enumerate(job["pp_prompts"].items()):
            if i == 0:
                engine.flush_cache()
                stream(ids, 1)  # warm-up at a prompt length
            times = []
            for _ in range(job["reps"]):
                engine.flush_cache()  # no prefix reuse: every run prefills all of it
                times.append(stream(ids, 1)[0])
            res["pp_ttft_s"][n] = statistics.median(times)
        res["rss_client_mb"] = vm_hwm_mb()
        res["rss_engine_worker_mb"] = vm_hwm_mb(engine.client.process.pid)
        res["peak_rss_mb"] = (res["rss_client_mb"] or 0) + (res["rss_engine_worker_mb"] or 0)
    finally:
        engine.close()
    return res


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def llama_extra_bufts_off() -> None:
    """ggml's extra buffer types (its AMX path and repacked weights) off for every Llama()
    built after this call: on the default SmolLM2 file its AMX path dies in llama_decode
    (SIGSEGV) for batches of 2+ tokens (bench/../shared/reference/PEERS.md); the model loads
    from the library's defaults otherwise."""
    import llama_cpp.llama_cpp as low  # what Llama() calls for its model parameters

    defaults = low.llama_model_default_params

    def no_extra():
        p = defaults()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = no_extra


def worker_llama(job: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - a missing or broken build skips the peer
        return {"skipped": f"llama_cpp is not importable: {type(exc).__name__}: {exc}"}
    imported = time.perf_counter() - t
    extra = job.get("llama_extra_bufts", "default")
    if extra == "off":
        llama_extra_bufts_off()
    t = time.perf_counter()
    llm = llama_cpp.Llama(job["model_path"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_batch=512, verbose=False)
    res: dict[str, Any] = {"import_s": imported, "load_s": time.perf_counter() - t,
                           "llama_cpp": getattr(llama_cpp, "__version__", None),
                           "path": "GGUF blocks as stored (ggml CPU kernels"
                                   + (", extra buffer types off: no AMX, no repacking)"
                                      if extra == "off" else ", the library's default buffers)")}

    def run(ids: list[int], n: int) -> tuple[float, float]:
        """(s to the first token, s from the first to the last): prompt eval, greedy loop."""
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = llm.sample(temp=0.0)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
        return t1 - t0, time.perf_counter() - t1

    run(job["warm_prompt"], job["tg_new"])  # warm-up: a whole decode run
    res["tg_tok_s"] = statistics.median([(job["tg_new"] - 1) / run(job["tg_prompt"], job["tg_new"])[1]
                               for _ in range(job["reps"])])
    res["pp_ttft_s"] = {}
    for i, (n, ids) in enumerate(job["pp_prompts"].items()):
        if i == 0:
            run(ids, 1)
        res["pp_ttft_s"][n] = statistics.median([run(ids, 1)[0] for _ in range(job["reps"])])
    # one sequence at a time: the concurrent requests run one after the other
    prompts, new = job["concurrent_prompts"], job["concurrent_new"]
    t = time.perf_counter()
    for p in prompts:
        run(p, new)
    wall = time.perf_counter() - t
    res["concurrent"] = {"method": "sequential (llama-cpp-python serves one sequence at a time)",
                         "requests": len(prompts), "output_tokens": len(prompts) * new,
                         "wall_s": wall, "output_tok_s": len(prompts) * new / wall}
    res["peak_rss_mb"] = vm_hwm_mb()
    return res


def worker_hf(job: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        import torch
        import transformers
        from hf_reference import hf_gguf_model  # tests/hf_reference.py
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"transformers is not importable: {type(exc).__name__}: {exc}"}
    imported = time.perf_counter() - t
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(job["threads"])
    dtype = getattr(torch, job["dtype"])
    t = time.perf_counter()
    model = hf_gguf_model(job["model_path"], dtype)
    res: dict[str, Any] = {"import_s": imported, "load_s": time.perf_counter() - t,
                           "transformers": transformers.__version__,
                           "path": f"GGUF dequantized to {job['dtype']} "
                                   f"({model.config._attn_implementation} attention)"}

    def gen(batch: list[list[int]], n: int) -> float:
        """Seconds for a greedy generate of n tokens for a left-padded batch."""
        width = max(len(x) for x in batch)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
        assert out.shape[1] == width + n, out.shape
        return dt

    gen([job["warm_prompt"]], job["tg_new"])  # warm-up: a whole decode run
    rates = []
    for _ in range(job["reps"]):
        t1, tn = gen([job["tg_prompt"]], 1), gen([job["tg_prompt"]], job["tg_new"])
        rates.append((job["tg_new"] - 1) / (tn - t1))
    res["tg_tok_s"] = statistics.median(rates)
    res["pp_ttft_s"] = {}
    for i, (n, ids) in enumerate(job["pp_prompts"].items()):
        if i == 0:
            gen([ids], 1)
        res["pp_ttft_s"][n] = statistics.median([gen([ids], 1) for _ in range(job["reps"])])
    if job["hf_concurrent"]:
        prompts, new = job["concurrent_prompts"], job["concurrent_new"]
        wall = gen(prompts, new)
        res["concurrent"] = {"method": "one left-padded batched generate", "requests":
                             len(prompts), "output_tokens": len(prompts) * new, "wall_s": wall,
                             "output_tok_s": len(prompts) * new / wall}
    res["peak_rss_mb"] = vm_hwm_mb()
    return res


def worker_ceiling(job: dict[str, Any]) -> dict[str, Any]:
    """This box's GEMM rate at the model's prefill shapes (torch / oneDNN, the run's threads
    and dtype), and what it bounds: the concurrent row's prefill alone at that rate (decode
    taken as free), so the most output tok/s any engine could reach on it."""
    import torch
    import torch.nn.functional as F
    from floors import prefill_flops_of, shapes

    from core.plan.gguf_metadata import gguf_to_hf_config, read_gguf_metadata

    torch.set_num_threads(job["threads"])
    cfg = gguf_to_hf_config(read_gguf_metadata(job["model_path"]))
    s = shapes(cfg)
    dtype = getattr(torch, job["dtype"])
    rows = 512  # a prefill chunk
    x = torch.randn(rows, s["h"], dtype=dtype)
    rates = {}
    for name, n_out in (("gate_up", 2 * s["inter"]), ("qkv", (s["heads"] + 2 * s["kv"]) * s["d"])):
        w = torch.randn(n_out, s["h"], dtype=dtype)
        for _ in range(3):
            F.linear(x, w)
        times = []
        for _ in range(max(5, job["reps"] * 5)):
            t = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - t)
        rates[name] = 2 * rows * n_out * s["h"] / statistics.median(times)
    rate = max(rates.values())
    lens = job["concurrent_prompt_lens"]
    flops = prefill_flops_of(cfg, lens)
    floor_s = flops / rate
    out_tokens = len(lens) * job["concurrent_new"]
    return {"gemm_flop_s": rate, "gemm_flop_s_by_shape": rates, "gemm_rows": rows,
            "concurrent_prompt_tokens": sum(lens), "concurrent_prefill_flops": flops,
            "concurrent_prefill_floor_s": floor_s,
            "concurrent_output_tok_s_max": out_tokens / floor_s}


WORKERS = {"ours": worker_ours, "llama.cpp": worker_llama, "hf": worker_hf,
           "ceiling": worker_ceiling}


def run_worker(peer: str, job_path: Path, timeout: float) -> dict[str, Any]:
    """This script with --worker PEER in a subprocess; its JSON result."""
    out = job_path.with_name(f"result_{peer}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--job",
           str(job_path), "--result", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or not out.exists():
        return {"error": f"worker exited with code {proc.returncode} (its output is above)"}
    res = json.loads(out.read_text())
    res["worker_wall_s"] = wall
    return res


def serve_concurrent(job: dict[str, Any], log: Path, timeout: float) -> dict[str, Any]:
    """Ours' concurrent row: `core serve` in a subprocess, every request sent at once."""
    from serving_online import ServerProcess, run_load, summarize_online

    flags = ["--model-path", job["model_path"], "--device", "cpu", "--dtype", job["dtype"],
             "--max-total-tokens", str(job["n_ctx"])]
    if job.get("quantization"):
        flags += ["--quantization", job["quantization"]]
    if job.get("disable_cuda_graph"):
        flags.append("--disable-cuda-graph")
    prompts, new = job["concurrent_prompts"], job["concurrent_new"]
    with ServerProcess(flags, log, timeout) as srv:
        warm, _ = asyncio.run(run_load(srv.url, srv.api_key, job["serve_warm_prompts"], 4,
                                       math.inf, None, seed=1))
        if not all(r.ok for r in warm):
            raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if not r.ok)} "
                               f"(server log: {log})")
        results, duration = asyncio.run(run_load(srv.url, srv.api_key, prompts, new, math.inf,
                                                 None))
        rss = tree_hwm_mb(srv.proc.pid)
        startup = srv.startup_s
    s = summarize_online(results, duration)
    if s["completed"] != len(prompts) or s["total_output_tokens"] != len(prompts) * new:
        raise RuntimeError(f"{s['completed']}/{len(prompts)} requests completed, "
                           f"{s['total_output_tokens']} of {len(prompts) * new} tokens: "
                           f"{s['errors']}; server log: {log}")
    return {"method": f"core serve, {len(prompts)} streamed /v1/completions requests at once "
                      "(token-id prompts, ignore_eos, temperature 0)",
            "requests": len(prompts), "output_tokens": s["total_output_tokens"],
            "wall_s": duration, "output_tok_s": s["output_tok_s"],
            "ttft_median_ms": s["ttft_median_ms"], "tpot_median_ms": s["tpot_median_ms"],
            "server_startup_s": startup, "server_peak_rss_mb": rss, "server_log": str(log)}


# -- the report -----------------------------------------------------------------------------------

def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per scenario: {"scenario", "unit", "higher_is_better", <peer>: value or None}."""
    w, res = report["workload"], report["results"]

    def get(peer: str, fn: Any) -> Any:
        r = res.get(peer) or {}
        try:
            return fn(r)
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    def row(name: str, unit: str, higher: bool, fn: Any) -> dict[str, Any]:
        return {"scenario": name, "unit": unit, "higher_is_better": higher,
                **{p: get(p, fn) for p in PEERS}}

    out = [row("path (weights, kernels)", "", True, lambda r: r["path"]),
           row(f"decode tg{w['tg_new']}, batch 1", "tok/s", True, lambda r: r["tg_tok_s"])]
    for n in w["pp_lens"]:
        out.append(row(f"prompt pp{n}", "tok/s", True,
                       lambda r, n=n: n / r["pp_ttft_s"][str(n)]))
    lo, hi = w["concurrent_lens"]
    out.append(row(f"{w['concurrent']} concurrent ({lo}..{hi} + {w['concurrent_new']}), "
                   "output", "tok/s", True, lambda r: r["concurrent"]["output_tok_s"]))
    out += [row(f"TTFT, {w['ttft_len']}-token prompt", "ms", False,
                lambda r: r["pp_ttft_s"][str(w["ttft_len"])] * 1e3),
            row("model load", "s", False, lambda r: r["load_s"]),
            row("peak RSS", "MB", False, lambda r: r["peak_rss_mb"])]
    for r in out:
        a, b = r["ours"], r["llama.cpp"]
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
        r["ours_vs_llama_cpp"] = round(a / b, 3) if ok else None
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def markdown_table(table: list[dict[str, Any]]) -> str:
    lines = ["| scenario | ours | llama.cpp | HF | ours / llama.cpp |",
             "|---|---|---|---|---|"]
    for r in table:
        unit = f" ({r['unit']}, {'higher' if r['higher_is_better'] else 'lower'} is better)" \
            if r["unit"] else ""
        ratio = "-" if r["ours_vs_llama_cpp"] is None else f"{r['ours_vs_llama_cpp']:.2f}x"
        lines.append(f"| {r['scenario']}{unit} | {_cell(r['ours'])} | "
                     f"{_cell(r['llama.cpp'])} | {_cell(r['hf'])} | {ratio} |")
    return "\n".join(lines)


def header(report: dict[str, Any]) -> str:
    m, v, w = report["machine"], report["versions"], report["workload"]
    return (f"{report['date']}: {m['model_name']}, {m['logical_cpus']} logical CPUs, ISA "
            f"{' '.join(m['isa']) or '-'} (not: {' '.join(m.get('isa_missing', [])) or '-'}); "
            f"{w['threads']} threads, {w['dtype']} (ours, HF), load {m['loadavg_1m']} -> "
            f"{report.get('loadavg_1m_end')}\n"
            f"python {v['python']}, torch {v['torch']}, llama_cpp {v['llama_cpp']}, "
            f"transformers {v['transformers']}; model {Path(w['model_path']).name}")


def notes(report: dict[str, Any]) -> list[str]:
    w, res = report["workload"], report["results"]
    out = [f"same token ids for every peer (random in [{ID_RANGE[0]}, {ID_RANGE[1]}), seed "
           f"{w['seed']}), greedy, EOS ignored; medians of {w['reps']} runs after a warm-up",
           "prompt pN = N / time to the first token of a 1-token request (ours: core.Engine, "
           "streamed, prefix cache flushed; llama.cpp: reset + eval + sample; HF: generate)"]
    for peer, r in res.items():
        for key in ("skipped", "error"):
            if key in r:
                out.append(f"{LABELS[peer]} {key}: {str(r[key])[:NOTE_CHARS]}")
        for what, err in (r.get("errors") or {}).items():  # whole in the JSON
            out.append(f"{LABELS[peer]} {what} error: {err[:NOTE_CHARS]}")
        if "concurrent" in r:
            out.append(f"{LABELS[peer]} concurrent: {r['concurrent']['method']}")
        wall = report.get("stage_wall_s", {}).get(peer)
        foreign = report.get("foreign_cpu_s", {}).get(peer)
        if wall and foreign is not None and foreign > FOREIGN_WARN * wall:
            out.append(f"WARNING: other processes took {foreign:.0f} CPU-s during the "
                       f"{wall:.0f} s of {LABELS[peer]}: its figures are skewed")
    c = report.get("ceiling") or {}
    tg = (res.get("llama.cpp") or {}).get("tg_tok_s")
    if "concurrent_prefill_floor_s" in c:
        bound = c["concurrent_output_tok_s_max"]
        vs = f" = {bound / tg:.2f}x llama.cpp's batch-1 rate" if tg else ""
        out.append(f"concurrent ceiling: the {len(w['concurrent_prompt_lens'])} prompts' "
                   f"prefill ({c['concurrent_prompt_tokens']} tokens, "
                   f"{c['concurrent_prefill_flops'] / 1e9:.0f} GFLOP) at this box's "
                   f"{c['gemm_flop_s'] / 1e9:.0f} GFLOP/s {w['dtype']} GEMM ({c['gemm_rows']}-row "
                   f"F.linear, measured now) takes {c['concurrent_prefill_floor_s']:.1f} s, so no "
                   f"engine outputs more than {bound:.0f} tok/s on that row{vs}, decode free")
    elif c.get("error"):
        out.append(f"ceiling error: {c['error'][:NOTE_CHARS]}")
    if "ours" in res and "plan" in res["ours"]:
        p = res["ours"]["plan"]
        out.append(f"ours plan: quant_method={p['quant_method']} (format {p['quant_format']}), "
                   f"dtype {p['dtype']}, attention {p['prefill_attention']} / "
                   f"{p['decode_attention']}, layer ops {p['layer_ops']}, KV {p['kv_cache_dtype']}")
    return out


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype of ours and HF (llama.cpp runs the GGUF as stored)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated subset of {', '.join(PEERS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama.cpp n_threads (and n_threads_batch); torch.set_num_threads, "
                        "OMP_NUM_THREADS and NUMBA_NUM_THREADS for ours and HF")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tg32, pp128 only, 4 concurrent requests")
    p.add_argument("--reps", type=int, default=None, help="measured runs (default 3; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pp-lens", default=None,
                   help="prompt lengths of the ppN rows, comma-separated (default 512,4096; "
                   "quick 128); the TTFT row's length is always added")
    p.add_argument("--llama-extra-bufts", choices=("default", "off"), default="default",
                   help="llama.cpp's extra buffer types (its AMX path, repacked weights): the "
                        "library default, or off (its AMX path crashes on the default model)")
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2 Q4_1 GGUF")
    p.add_argument("--quantization", default=None,
                   help="ours' quant method (default: the resolver's choice), e.g. gguf_avx512 "
                        "for the VNNI path on a CPU with AMX")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="ours without decode graphs (CPU graphs of C calls are on by default)")
    p.add_argument("--hf-concurrent", action=argparse.BooleanOptionalAction, default=True,
                   help="HF's padded batched generate for the concurrent row")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per peer")
    p.add_argument("--worker", choices=(*PEERS, "ceiling"), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.peers = choice_list(p, "--peers", a.peers, PEERS)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    if a.reps is None:
        a.reps = 1 if a.quick else 3
    if a.reps < 1:
        p.error("--reps must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        job = json.loads(Path(a.job).read_text())
        res = WORKERS[a.worker](job)
        Path(a.result).write_text(json.dumps(res))
        return 0
    if a.model_path is None:
        from core.plan.default_model import default_model_path
        a.model_path = default_model_path()
    # every process from here on (workers, engine workers, the server) runs this many threads
    os.environ["OMP_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    job = workload(a)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": cpu_info(),
        "versions": {"python": platform.python_version(), "torch": version("torch"),
                     "llama_cpp": version("llama_cpp_python"),
                     "transformers": version("transformers")},
        "workload": {k: v for k, v in job.items() if not k.endswith(("prompts", "prompt"))},
        "peers": a.peers, "results": {}, "stage_wall_s": {}, "foreign_cpu_s": {}}
    failed: list[str] = []

    def save() -> None:  # after every stage, so a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="bench_cpu_peers_") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        for peer in a.peers:
            t, (busy0, own0) = time.perf_counter(), cpu_seconds()
            if peer == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
                res = {"skipped": "llama_cpp is not importable (pip install llama-cpp-python)"}
            else:
                print(f"--- {peer}", flush=True)
                try:
                    res = run_worker(peer, job_path, a.timeout)
                except subprocess.TimeoutExpired:
                    res = {"error": f"timed out after {a.timeout:.0f} s"}
            if peer == "ours":
                log = Path(a.out).with_suffix(".server.log") if a.out else Path(tmp) / "srv.log"
                print("--- ours: core serve", flush=True)
                try:
                    res["concurrent"] = serve_concurrent(job, log, a.timeout)
                except Exception as exc:  # noqa: BLE001 - keep the other rows
                    traceback.print_exc()
                    res.setdefault("errors", {})["concurrent"] = f"{type(exc).__name__}: {exc}"
                    failed.append("ours concurrent")
            if "error" in res:
                failed.append(peer)
            report["results"][peer] = res
            wall = time.perf_counter() - t
            busy1, own1 = cpu_seconds()
            # CPU time other processes took while this peer ran: they skew its figures
            report["stage_wall_s"][peer] = round(wall, 1)
            report["foreign_cpu_s"][peer] = round(max(busy1 - busy0 - (own1 - own0), 0.0), 1)
            save()
        print("--- ceiling", flush=True)
        try:
            report["ceiling"] = run_worker("ceiling", job_path, a.timeout)
        except Exception as exc:  # noqa: BLE001 - the peers' rows stand without it
            report["ceiling"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    report["rows"] = rows(report)
    report["notes"] = notes(report)
    report["table"] = markdown_table(report["rows"])
    report["failed"] = failed
    save()
    print()
    print(header(report))
    print()
    print(report["table"])
    print()
    for n in report["notes"]:
        print(f"- {n}")
    if a.out:
        print(f"\nwritten to {a.out}")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (see the JSON)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
