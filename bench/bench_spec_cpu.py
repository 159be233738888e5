"""Speculative decoding on the CPU at batch 1: ours off / ngram / suffix against llama.cpp with
and without its prompt-lookup decoding, on the same GGUF and the same prompt token ids.

    OMP_NUM_THREADS=1 nice -n -20 python bench/bench_spec_cpu.py --out spec.json
    python bench/bench_spec_cpu.py --quick                     # 2 prompts a set, 32 tokens
    python bench/bench_spec_cpu.py --configs ours:off,ours:ngram,ours:standalone

The model is the default one (SmolLM2-135M-Instruct Q4_1, `core.plan.default_model`). The prompt
sets are bench/spec_prompts.py: input_grounded (repeat / edit a paragraph, quote a text,
rewrite code with a small change) and open_ended (chat, the negative case). Each prompt is
rendered by the model's chat template (our tokenizer) into token ids once; every engine gets
those ids. Greedy (temperature 0), --max-new-tokens new tokens at most, EOS honoured (an answer
ends where the model ends it, as a user sees it; ours' answers with and without speculation
have the same length because they are the same tokens).

Every config runs in its own subprocess (this script with --worker CONFIG), one request at a
time, after a warm-up request whose prompt is in no set (so suffix's cache of earlier outputs
never holds a measured answer before it is measured; within a set, earlier answers of the
set are in it, as in a session). Per request: the time to the first streamed token, the time
from the first to the last token; per set:
- decode tok/s = sum(tokens after the first) / sum(first-to-last seconds) (the figure the
  targets are about: prefill is the same with speculation on and off);
- end-to-end tok/s = sum(tokens) / sum(request seconds);
- ours: the engine worker's CPU seconds (utime + stime from /proc) per output token, a figure
  other load on the machine barely moves; acceptance = accepted / drafted tokens and the mean
  accepted length = accepted / verify steps (both from the requests' meta_info counters), and
  tokens per verify step.
llama.cpp: llama-cpp-python's Llama.generate on the same ids, greedy, EOS honoured; with
prompt lookup its `LlamaPromptLookupDecoding(num_pred_tokens=N)` is the draft_model (its README:
10 suits a GPU, 2 a CPU-only machine; --llama-pred-tokens runs each, the best is compared).

Ours' greedy answers with speculation must equal those without it token for token: the script
compares them and exits 1 on a mismatch, naming the prompts and where they diverge (a bug to
report, not to hide). CPU time other processes took during each config is measured (/proc/stat
minus our own process tree) and a note warns above 10% of the stage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_cpu_peers import (  # noqa: E402
    FOREIGN_WARN,
    cpu_info,
    cpu_seconds,
    llama_extra_bufts_off,
    proc_cpu_s,
    version,
)
from cli_lists import choice_list  # noqa: E402
from spec_prompts import SETS  # noqa: E402

OURS_ALGS = ("off", "ngram", "suffix", "standalone")
CONFIGS = tuple(f"ours:{a}" for a in OURS_ALGS) + ("llama.cpp:off", "llama.cpp:lookup")
DEFAULT_CONFIGS = ("ours:off", "ours:ngram", "ours:suffix", "llama.cpp:off", "llama.cpp:lookup")
WARM_MESSAGES = [{"role": "user", "content": "Say hello and name three colours."}]
N_CTX = 4096
NOTE_CHARS = 400


# -- the workload ---------------------------------------------------------------------------------

def check_sets(sets: dict[str, list[dict]] = SETS) -> None:
    """The prompt sets' shape: unique names, non-empty user messages; raises ValueError."""
    seen: set[str] = set()
    for set_name, prompts in sets.items():
        if not prompts:
            raise ValueError(f"set {set_name} is empty")
        for p in prompts:
            name = p.get("name")
            if not name or name in seen:
                raise ValueError(f"set {set_name}: prompt name {name!r} missing or repeated")
            seen.add(name)
            msgs = p.get("messages")
            if not msgs or any(m.get("role") not in ("system", "user", "assistant")
                               or not str(m.get("content", "")).strip() for m in msgs):
                raise ValueError(f"prompt {name}: messages must be non-empty chat turns")
            if msgs[-1]["role"] != "user":
                raise ValueError(f"prompt {name}: the last turn must be the user's")


def select(sets: dict[str, list[dict]], names: list[str], quick: bool) -> dict[str, list[dict]]:
    return {s: (sets[s][:2] if quick else sets[s]) for s in names}


def render(model_path: str, sets: dict[str, list[dict]]) -> dict[str, Any]:
    """Token ids of every prompt (and the warm-up), by our tokenizer and the chat template."""
    from core.engine.loader import load_tokenizer
    from core.plan.args import make_server_args

    tok = load_tokenizer(make_server_args(model_path=model_path))

    def ids(messages: list[dict]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)

    return {"warm": ids(WARM_MESSAGES), "eos": sorted(tok.eos_token_ids),
            "sets": {s: [{"name": p["name"], "ids": ids(p["messages"])} for p in ps]
                     for s, ps in sets.items()}}


# -- workers (each in its own process) ------------------------------------------------------------

def worker_ours(job: dict[str, Any], alg: str) -> dict[str, Any]:
    import torch

    import core
    torch.set_num_threads(job["threads"])
    kw: dict[str, Any] = {"device": "cpu", "max_total_tokens": N_CTX}
    if job.get("dtype"):
        kw["dtype"] = job["dtype"]
    if job.get("quantization"):
        kw["quantization"] = job["quantization"]
    if alg != "off":
        kw.update(speculative_algorithm=alg, speculative_num_draft_tokens=job["draft_tokens"])
        if job.get("governor"):
            kw["speculative_governor"] = job["governor"]
        if alg == "standalone":
            kw["speculative_draft_model_path"] = job["model_path"]
    t = time.perf_counter()
    engine = core.Engine(job["model_path"], **kw)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t}
    try:
        plan = engine.plan
        res["path"] = (f"quant {plan.quant_method} (weights {plan.quant_format}, compute "
                       f"{plan.dtype}), {plan.decode_attention} attention")
        pid = engine.client.process.pid
        sp = {"max_new_tokens": job["max_new_tokens"], "temperature": 0.0}

        def one(ids: list[int]) -> dict[str, Any]:
            t0 = time.perf_counter()
            c0 = proc_cpu_s(pid)
            first = last = c_first = None
            out: list[int] = []
            meta: dict[str, Any] = {}
            for chunk in engine.generate(input_ids=ids, sampling_params=sp, stream=True):
                if chunk["token_ids"]:
                    last = time.perf_counter()
                    if first is None:
                        first, c_first = last, proc_cpu_s(pid)
                    out += chunk["token_ids"]
                meta = chunk.get("meta_info") or meta
            c_end = proc_cpu_s(pid)
            return {"ttft_s": first - t0, "decode_s": last - first, "total_s": last - t0,
                    "worker_cpu_s": c_end - c0, "decode_cpu_s": c_end - c_first,
                    "output_ids": out,
                    **{k: meta[k] for k in ("spec_verify_ct", "spec_draft_tokens",
                                            "spec_accepted_tokens", "spec_note") if k in meta}}

        one(job["warm"])
        res["sets"] = {s: [{"name": p["name"], **one(p["ids"])} for p in ps]
                       for s, ps in job["sets"].items()}
    finally:
        engine.close()
    return res


def worker_llama(job: dict[str, Any], mode: str) -> dict[str, Any]:
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except Exception as exc:  # noqa: BLE001 - a missing or broken build skips the peer
        return {"skipped": f"llama_cpp is not importable: {type(exc).__name__}: {exc}"}
    if job.get("llama_extra_bufts") == "off":  # no AMX / repacking, as in bench_cpu_peers.py
        llama_extra_bufts_off()
    eos = set(job["eos"])
    runs: dict[str, Any] = {}
    preds = [0] if mode == "off" else job["llama_pred_tokens"]
    for n_pred in preds:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=n_pred) if n_pred else None
        t = time.perf_counter()
        llm = llama_cpp.Llama(job["model_path"], n_ctx=N_CTX, n_threads=job["threads"],
                              n_threads_batch=job["threads"], n_batch=512, verbose=False,
                              draft_model=draft)
        load = time.perf_counter() - t

        def one(llm: Any, ids: list[int]) -> dict[str, Any]:
            llm.reset()
            out: list[int] = []
            t0 = time.perf_counter()
            first = last = None
            for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                last = time.perf_counter()
                first = first or last
                if tok in eos:
                    break
                out.append(int(tok))
                if len(out) >= job["max_new_tokens"]:
                    break
            return {"ttft_s": first - t0, "decode_s": last - first, "total_s": last - t0,
                    "output_ids": out}

        one(llm, job["warm"])
        runs[str(n_pred)] = {"load_s": load, "sets": {
            s: [{"name": p["name"], **one(llm, p["ids"])} for p in ps]
            for s, ps in job["sets"].items()}}
        del llm
    return {"llama_cpp": getattr(llama_cpp, "__version__", None), "runs": runs,
            "path": "GGUF blocks as stored (ggml CPU kernels"
                    + (", extra buffer types off)" if job.get("llama_extra_bufts") == "off"
                       else ", the library's default buffers)")}


def run_worker(config: str, job_path: Path, timeout: float) -> dict[str, Any]:
    out = job_path.with_name(f"result_{config.replace(':', '_')}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", config, "--job",
           str(job_path), "--result", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"worker exited with code {proc.returncode} (its output is above)"}
    return json.loads(out.read_text())


# -- the report -----------------------------------------------------------------------------------

def summarize(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """One set's figures from its requests."""
    tokens = sum(len(r["output_ids"]) for r in reqs)
    after = sum(max(len(r["output_ids"]) - 1, 0) for r in reqs)
    decode_s = sum(r["decode_s"] for r in reqs)
    s: dict[str, Any] = {"requests": len(reqs), "tokens": tokens, "decode_tokens": after,
                         "decode_s": decode_s,
                         "decode_tok_s": after / decode_s if decode_s else None,
                         "e2e_tok_s": tokens / sum(r["total_s"] for r in reqs)}
    if all("worker_cpu_s" in r for r in reqs):
        s["worker_cpu_ms_per_tok"] = 1e3 * sum(r["worker_cpu_s"] for r in reqs) / tokens
    if all("decode_cpu_s" in r for r in reqs):  # the engine worker's CPU time, not wall time
        cpu = sum(r["decode_cpu_s"] for r in reqs)
        s["decode_tok_per_cpu_s"] = after / cpu if cpu else None
    drafted = sum(r.get("spec_draft_tokens", 0) for r in reqs)
    steps = sum(r.get("spec_verify_ct", 0) for r in reqs)
    if any("spec_draft_tokens" in r for r in reqs):
        acc = sum(r.get("spec_accepted_tokens", 0) for r in reqs)
        s.update(drafted=drafted, accepted=acc, verify_steps=steps,
                 acceptance=acc / drafted if drafted else None,
                 mean_accepted_len=acc / steps if steps else None)
    return s


def figures(report: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {column: summary}}; llama.cpp's lookup column is its best num_pred_tokens."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for config, res in report["results"].items():
        if "sets" in res:
            for s, reqs in res["sets"].items():
                out.setdefault(s, {})[config] = summarize(reqs)
        for n, run in (res.get("runs") or {}).items():
            for s, reqs in run["sets"].items():
                summ = summarize(reqs)
                if n == "0":  # llama.cpp without a draft model
                    out.setdefault(s, {})[config] = summ
                    continue
                summ["num_pred_tokens"] = int(n)
                out.setdefault(s, {})[f"{config}/{n}"] = summ
                best = out[s].get(config)
                if best is None or (summ["decode_tok_s"] or 0) > (best["decode_tok_s"] or 0):
                    out[s][config] = summ
    step_costs(out)
    return out


def step_costs(fig: dict[str, dict[str, dict[str, Any]]]) -> None:
    """A profile from the counters, in place: the mean wall time of one verify step (1 + k
    tokens in one forward) over that of one plain decode step of ours:off in the same set.
    The decode phase of a speculative run is plain steps (no draft found) and verify steps;
    each verify step emits accepted + 1 tokens, each plain step one, so
    plain = decode_tokens - verify_steps - accepted, and the verify steps took the rest of the
    decode time once the plain steps are charged at ours:off's rate. Approximate: drafts accepted
    past a stop token count as accepted but are not emitted (plain steps are floored at 0);
    for standalone the verify step includes the draft model's forwards."""
    for cols in fig.values():
        off = cols.get("ours:off")
        if not off or not off.get("decode_tok_s"):
            continue
        plain_s = 1.0 / off["decode_tok_s"]
        for c, v in cols.items():
            if not c.startswith("ours:") or not v.get("verify_steps"):
                continue
            plain = max(v["decode_tokens"] - v["verify_steps"] - v["accepted"], 0)
            verify_s = (v["decode_s"] - plain * plain_s) / v["verify_steps"]
            v["plain_steps"] = plain
            v["verify_step_vs_plain"] = verify_s / plain_s
            v["tokens_per_verify_step"] = 1 + v["accepted"] / v["verify_steps"]


def mismatches(report: dict[str, Any]) -> list[str]:
    """Prompts whose greedy answer with speculation differs from ours without it."""
    base = report["results"].get("ours:off", {}).get("sets")
    out = []
    if not base:
        return out
    for config, res in report["results"].items():
        if not config.startswith("ours:") or config == "ours:off" or "sets" not in res:
            continue
        for s, reqs in res["sets"].items():
            for want, got in zip(base[s], reqs, strict=True):
                a, b = want["output_ids"], got["output_ids"]
                if a != b:
                    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                              min(len(a), len(b)))
                    out.append(f"{config} {s}/{want['name']}: differs from ours:off at token "
                               f"{at} ({len(a)} vs {len(b)} tokens)")
    return out


def agreement(report: dict[str, Any]) -> list[str]:
    """How many of llama.cpp's greedy answers equal ours without speculation (information: two
    engines' kernels round differently, so near-ties may break differently)."""
    base = report["results"].get("ours:off", {}).get("sets")
    out = []
    for config, res in report["results"].items():
        for n, run in (res.get("runs") or {}).items():
            if not base:
                continue
            for s, reqs in run["sets"].items():
                same = sum(w["output_ids"] == g["output_ids"]
                           for w, g in zip(base[s], reqs, strict=True))
                label = config if n == "0" else f"{config}/{n}"
                out.append(f"{label} {s}: {same}/{len(reqs)} answers identical to ours:off")
    return out


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown_table(fig: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| set | ours off | ngram | suffix | ngram / off | suffix / off | acceptance "
             "ngram / suffix | mean accepted len ngram / suffix | llama.cpp off | "
             "llama.cpp lookup (N) | lookup / llama.cpp off | ours ngram / llama.cpp lookup | "
             "ngram / off, suffix / off by worker CPU time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, cols in fig.items():
        def get(c: str, k: str, cols: dict = cols) -> Any:
            return (cols.get(c) or {}).get(k)

        def tps(c: str) -> Any:
            return get(c, "decode_tok_s")

        def cpu(c: str) -> Any:
            return get(c, "decode_tok_per_cpu_s")

        look = cols.get("llama.cpp:lookup") or {}
        n = f" ({look['num_pred_tokens']})" if "num_pred_tokens" in look else ""
        lines.append(
            f"| {s} | {_num(tps('ours:off'))} | {_num(tps('ours:ngram'))} | "
            f"{_num(tps('ours:suffix'))} | {_ratio(tps('ours:ngram'), tps('ours:off'))} | "
            f"{_ratio(tps('ours:suffix'), tps('ours:off'))} | "
            f"{_num(get('ours:ngram', 'acceptance'), '{:.2f}')} / "
            f"{_num(get('ours:suffix', 'acceptance'), '{:.2f}')} | "
            f"{_num(get('ours:ngram', 'mean_accepted_len'), '{:.2f}')} / "
            f"{_num(get('ours:suffix', 'mean_accepted_len'), '{:.2f}')} | "
            f"{_num(tps('llama.cpp:off'))} | {_num(tps('llama.cpp:lookup'))}{n} | "
            f"{_ratio(tps('llama.cpp:lookup'), tps('llama.cpp:off'))} | "
            f"{_ratio(tps('ours:ngram'), tps('llama.cpp:lookup'))} | "
            f"{_ratio(cpu('ours:ngram'), cpu('ours:off'))}, "
            f"{_ratio(cpu('ours:suffix'), cpu('ours:off'))} |")
    return "\n".join(lines)


def detail_table(fig: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| set | config | tokens | decode tok/s | decode tok per worker CPU-s | "
             "end-to-end tok/s | worker CPU ms/token | "
             "drafted | accepted | verify steps | plain steps | acceptance | mean accepted len "
             "| verify step / plain step (time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, cols in fig.items():
        for c, v in cols.items():
            lines.append(
                f"| {s} | {c} | {v['tokens']} | {_num(v['decode_tok_s'])} | "
                f"{_num(v.get('decode_tok_per_cpu_s'))} | "
                f"{_num(v['e2e_tok_s'])} | {_num(v.get('worker_cpu_ms_per_tok'), '{:.2f}')} | "
                f"{v.get('drafted', '-')} | {v.get('accepted', '-')} | "
                f"{v.get('verify_steps', '-')} | {v.get('plain_steps', '-')} | "
                f"{_num(v.get('acceptance'), '{:.2f}')} | "
                f"{_num(v.get('mean_accepted_len'), '{:.2f}')} | "
                f"{_num(v.get('verify_step_vs_plain'), '{:.2f}')} |")
    return "\n".join(lines)


def targets(fig: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Issue 33's CPU targets, each met or missed, from this run's figures."""
    out = []

    def tps(s: str, c: str) -> Any:
        return ((fig.get(s) or {}).get(c) or {}).get("decode_tok_s")

    for alg in ("ngram", "suffix"):
        on, off = tps("input_grounded", f"ours:{alg}"), tps("input_grounded", "ours:off")
        if on and off:
            out.append(f"input_grounded {alg} / off = {on / off:.2f}x (target >= 1.8x): "
                       f"{'met' if on / off >= 1.8 else 'missed'}")
        look = tps("input_grounded", "llama.cpp:lookup")
        if on and look:
            out.append(f"input_grounded {alg} / llama.cpp lookup = {on / look:.2f}x "
                       f"(target >= 1.5x): {'met' if on / look >= 1.5 else 'missed'}")
        on, off = tps("open_ended", f"ours:{alg}"), tps("open_ended", "ours:off")
        if on and off:
            out.append(f"open_ended {alg} / off = {on / off:.2f}x (target >= 0.95x): "
                       f"{'met' if on / off >= 0.95 else 'missed'}")
    return out


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (ours:standalone: "
                        "the model itself as its own draft)")
    p.add_argument("--sets", default=",".join(SETS),
                   help=f"comma-separated subset of {', '.join(SETS)}")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 160 (quick 32)")
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="ours: --speculative-num-draft-tokens")
    p.add_argument("--llama-pred-tokens", default="2,10",
                   help="llama.cpp: num_pred_tokens of LlamaPromptLookupDecoding to run "
                        "(comma-separated; the best is compared)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--governor", choices=("on", "off"), default=None,
                   help="ours: --speculative-governor (default: the engine's)")
    p.add_argument("--dtype", default=None, help="ours' compute dtype (default: the plan's)")
    p.add_argument("--quantization", default=None, help="ours' quant method (default: the plan's)")
    p.add_argument("--llama-extra-bufts", choices=("default", "off"), default="off",
                   help="llama.cpp's extra buffer types (AMX path, repacked weights); off by "
                        "default: with them its AMX path dies (SIGSEGV) on the default model "
                        "for batches of 2+ tokens, i.e. every prompt and every lookup verify")
    p.add_argument("--quick", action="store_true", help="2 prompts a set, 32 new tokens")
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2 Q4_1 GGUF")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per config")
    p.add_argument("--from-json", default=None,
                   help="no run: rebuild the tables from an earlier --out report")
    p.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.configs = choice_list(p, "--configs", a.configs, CONFIGS)
    a.sets = choice_list(p, "--sets", a.sets, tuple(SETS))
    if a.max_new_tokens is None:
        a.max_new_tokens = 32 if a.quick else 160
    try:
        a.llama_pred_tokens = [int(x) for x in a.llama_pred_tokens.split(",") if x.strip()]
    except ValueError:
        p.error("--llama-pred-tokens takes comma-separated integers")
    if not a.llama_pred_tokens or min(a.llama_pred_tokens) < 1:
        p.error("--llama-pred-tokens must be integers >= 1")
    for name in ("max_new_tokens", "draft_tokens", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        job = json.loads(Path(a.job).read_text())
        kind, mode = a.worker.split(":")
        res = worker_ours(job, mode) if kind == "ours" else worker_llama(job, mode)
        Path(a.result).write_text(json.dumps(res))
        return 0
    if a.from_json:  # the report's tables again, from its raw results
        report = json.loads(Path(a.from_json).read_text())
        return finish(report, a.out, [c for c, r in report["results"].items() if "error" in r])
    check_sets()
    if a.model_path is None:
        from core.plan.default_model import default_model_path
        a.model_path = default_model_path()
    os.environ["OMP_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    job = {"model_path": a.model_path, "threads": a.threads, "dtype": a.dtype,
           "quantization": a.quantization, "governor": a.governor,
           "max_new_tokens": a.max_new_tokens,
           "draft_tokens": a.draft_tokens, "llama_pred_tokens": a.llama_pred_tokens,
           "llama_extra_bufts": a.llama_extra_bufts,
           **render(a.model_path, select(SETS, a.sets, a.quick))}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": cpu_info(),
        "versions": {"python": platform.python_version(), "torch": version("torch"),
                     "llama_cpp": version("llama_cpp_python")},
        "workload": {k: v for k, v in job.items() if k not in ("sets", "warm")},
        "prompt_tokens": {s: {p["name"]: len(p["ids"]) for p in ps}
                          for s, ps in job["sets"].items()},
        "results": {}, "stage_wall_s": {}, "foreign_cpu_s": {}}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2, default=str))

    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench_spec_cpu_") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        for config in a.configs:
            t, (busy0, own0) = time.perf_counter(), cpu_seconds()
            if config.startswith("llama.cpp") and importlib.util.find_spec("llama_cpp") is None:
                res = {"skipped": "llama_cpp is not importable (pip install llama-cpp-python)"}
            else:
                print(f"--- {config}", flush=True)
                try:
                    res = run_worker(config, job_path, a.timeout)
                except subprocess.TimeoutExpired:
                    res = {"error": f"timed out after {a.timeout:.0f} s"}
                except Exception as exc:  # noqa: BLE001 - keep the other configs
                    traceback.print_exc()
                    res = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in res:
                failed.append(config)
            report["results"][config] = res
            wall = time.perf_counter() - t
            busy1, own1 = cpu_seconds()
            report["stage_wall_s"][config] = round(wall, 1)
            report["foreign_cpu_s"][config] = round(max(busy1 - busy0 - (own1 - own0), 0.0), 1)
            save()
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return finish(report, a.out, failed)


def finish(report: dict[str, Any], out: str | None, failed: list[str]) -> int:
    """Figures, tables, notes and the check of ours' answers from a report's raw results;
    printed, and written to `out`."""
    w = report["workload"]
    fig = figures(report)
    report["figures"] = fig
    report["mismatches"] = mismatches(report)
    report["targets"] = targets(fig)
    report["table"] = markdown_table(fig)
    report["detail"] = detail_table(fig)
    notes = []
    for config, res in report["results"].items():
        for key in ("skipped", "error"):
            if key in res:
                notes.append(f"{config} {key}: {str(res[key])[:NOTE_CHARS]}")
        if "path" in res:
            notes.append(f"{config}: {res['path']}")
        wall, foreign = report["stage_wall_s"][config], report["foreign_cpu_s"][config]
        notes.append(f"{config}: other processes took {foreign:.0f} CPU-s during its "
                     f"{wall:.0f} s" + (" (WARNING: its figures are skewed)"
                                        if foreign > FOREIGN_WARN * wall else ""))
    notes += agreement(report)
    report["notes"] = notes
    if out:
        Path(out).write_text(json.dumps(report, indent=2, default=str))
    m = report["machine"]
    print(f"\n{report['date']}: {m['model_name']}, ISA {' '.join(m['isa']) or '-'}; "
          f"{w['threads']} thread(s); load {m['loadavg_1m']} -> {report['loadavg_1m_end']}; "
          f"max_new_tokens {w['max_new_tokens']}, draft tokens {w['draft_tokens']}, "
          f"governor {w.get('governor') or 'default'}, EOS honoured\n")
    print(report["table"] + "\n\n" + report["detail"] + "\n")
    for line in report["targets"] + notes:
        print(f"- {line}")
    if report["mismatches"]:
        print("\nGREEDY MISMATCH (speculation changed ours' answers):")
        for line in report["mismatches"]:
            print(f"- {line}")
    if out:
        print(f"\nwritten to {out}")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (see the JSON)")
    return 1 if failed or report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
