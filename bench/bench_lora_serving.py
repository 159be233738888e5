"""Multi-LoRA serving against the base model, one run: issue 36's engine targets.

    python bench/bench_lora_serving.py --out lora_serving.json     # CUDA: Llama-3.1-8B, bf16
    python bench/bench_lora_serving.py --device cpu                # tiny random Llama, seconds

The targets (H200, Llama-3.1-8B shapes, 8 rank-16 adapters on every projection): batch 1 at
least 0.85x the base model's tokens/s; 64 concurrent requests spread over the 8 adapters at
least 0.8x the base model's throughput.

The model is a config (--config; default tests/fixtures/configs/llama-3.1-8b.json, on the CPU a
tiny Llama) served with --load-format dummy, plus a word-level tokenizer (bench_serving.py's).
--num-adapters random PEFT adapters (adapter_config.json + adapter_model.safetensors) of rank
--lora-rank on all of q, k, v, o, gate, up and down are written to a temporary directory: A ~
N(0, 1/in), B ~ N(0, 0.02^2) (non-zero, so the delta is really computed), scaling
--lora-alpha / rank. Engines, one after the other in this process (each its own worker):

- base: no LoRA;
- lora: --enable-lora --lora-paths (every adapter) --max-loras-per-batch --num-adapters
  --max-lora-rank --lora-rank --lora-backend (default auto: the resolver's choice; the report
  names the backend the plan chose);
- base_eager (graphs on, unless --skip-eager-base): the base with --disable-cuda-graph,
  what the graphs give the base. With a graph-safe LoRA backend (triton) the decode graphs hold
  the LoRA path (core/contract/graphs.py): steps serving adapters replay them like base steps,
  so "decode steps from graphs" reads n/n on the LoRA engine too (steps above the largest
  bucket aside) and a gap to the base is the delta's cost; with one that is not graph safe the
  plan captures no graphs (its notes say so) and adapter requests run eagerly.

Measured on each (greedy, ignore_eos, random-token prompts of --input-len, --output-len new
tokens): batch 1 (--batch1-requests requests one after the other: decode tokens/s = 1 / median
time per output token, and output tokens / wall), base requests and, on the LoRA engine,
adapter requests (request i on adapter i mod N); concurrent (--concurrent requests submitted at
once, --rounds times: output tokens / wall), base requests and, on the LoRA engine, requests
round-robin over the adapters. Every engine first serves a short warm-up of each kind (every
adapter copied into its slot, kernels compiled at these shapes). Ratios are against the base
engine in the same run; the LoRA engine's base requests give the cost of just enabling LoRA.
Per measurement the decode steps run and those replayed from CUDA graphs are counted.

Checks (exit 1 when one fails): every request gets --output-len tokens; the adapters' greedy
tokens differ from the base model's on the same prompts (the delta is applied). Reported too:
how many of the LoRA engine's base requests match the base engine's tokens (equal in fp32 on
a CPU; bf16 on a GPU may differ on near ties). Results are one JSON (--out, written after every
engine), then a markdown table. --device cuda without CUDA prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# this checkout (and its tests/ helpers), whatever else is installed
for _p in (str(BENCH_DIR), str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_serving import TINY, make_model_dir, prompts  # noqa: E402
from model_fixtures import write_config_adapter  # noqa: E402
from serving_online import latency_stats  # noqa: E402
from serving_report import jsonable, ratio  # noqa: E402
from stages import Stages, new_report  # noqa: E402

DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
TARGETS = {"batch1": 0.85, "concurrent": 0.8}  # issue 36: adapter runs against the base's
# (cuda, cpu) defaults of the flags left unset: about 4 minutes on an H200 (three engines'
# start-ups most of it), seconds on a CPU
DEFAULTS = {"dtype": ("bfloat16", "float32"), "input_len": (128, 16), "output_len": (128, 8),
            "batch1_requests": (4, 2), "concurrent": (64, 8), "max_total_tokens": (None, 4096)}
WARMUP_TOKENS = 4


def write_adapters(cfg: dict[str, Any], root: Path, n: int, rank: int, alpha: float,
                   dtype: torch.dtype) -> dict[str, str]:
    """n random PEFT adapters on every projection of cfg's Llama: {name: path}."""
    shape = types.SimpleNamespace(**cfg)
    return {f"lora{i}": str(write_config_adapter(root / f"lora{i}", shape, rank, alpha, i + 1,
                                                 dtype))
            for i in range(n)}


def timed(engine: Any, batch: list[list[int]], loras: list[str | None], out_len: int
          ) -> dict[str, Any]:
    """Submit `batch` at once (request i on adapter loras[i], None: the base) and stream it;
    throughput, latencies and each request's tokens ("tokens", not for the JSON)."""
    sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    n = len(batch)
    first: list[float | None] = [None] * n
    last = [0.0] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=batch, sampling_params=sp, stream=True,
                                 lora_path=loras):
        now = time.perf_counter()
        i = chunk["index"]
        if chunk["token_ids"]:
            if first[i] is None:
                first[i] = now
            last[i] = now
            tokens[i] += chunk["token_ids"]
    wall = time.perf_counter() - t0
    count = [len(t) for t in tokens]
    done = [i for i in range(n) if first[i] is not None]
    out = sum(count)
    return {"requests": n, "output_tokens": out, "wall_s": wall, "output_tok_s": out / wall,
            "output_tokens_min": min(count, default=0),
            "output_tokens_max": max(count, default=0),
            **latency_stats("ttft", [first[i] - t0 for i in done]),
            **latency_stats("tpot", [(last[i] - first[i]) / (count[i] - 1)
                                     for i in done if count[i] > 1]),
            "tokens": tokens}


class Counted:
    """The engine's decode steps and graph replays over a measurement."""

    def __init__(self, engine: Any):
        self.engine = engine

    def __enter__(self) -> Counted:
        self.before = self.engine.stats()
        return self

    def __exit__(self, *exc: object) -> None:
        after = self.engine.stats()
        self.decode_steps = (after["forward_count"]["decode"]
                             - self.before["forward_count"]["decode"])
        self.graph_replays = (after.get("graph_replays") or 0) - (
            self.before.get("graph_replays") or 0)

    def into(self, res: dict[str, Any]) -> dict[str, Any]:
        res.update(decode_steps=self.decode_steps, graph_replays=self.graph_replays)
        return res


def batch1(engine: Any, ps: list[list[int]], loras: list[str | None], out_len: int
           ) -> dict[str, Any]:
    """The prompts one after the other: decode tokens/s = 1 / median time per output token
    (over all requests' TPOTs' median), output tokens / summed wall."""
    with Counted(engine) as c:
        runs = [timed(engine, [p], [lora], out_len) for p, lora in zip(ps, loras, strict=True)]
    tpots = sorted(r["tpot_median_ms"] for r in runs if r["tpot_median_ms"])
    med = tpots[len(tpots) // 2] if tpots else None
    wall = sum(r["wall_s"] for r in runs)
    out = sum(r["output_tokens"] for r in runs)
    return c.into({
        "requests": len(runs), "output_tokens": out, "wall_s": wall,
        "output_tok_s": out / wall, "decode_tok_s": 1e3 / med if med else None,
        "tpot_median_ms": med, "ttft_median_ms": sorted(r["ttft_median_ms"] for r in runs)[
            len(runs) // 2],
        "output_tokens_min": min(r["output_tokens_min"] for r in runs),
        "output_tokens_max": max(r["output_tokens_max"] for r in runs),
        "tokens": [r["tokens"][0] for r in runs]})


def concurrent(engine: Any, ps: list[list[int]], loras: list[str | None], out_len: int,
               rounds: int) -> dict[str, Any]:
    """`rounds` times all prompts at once: output tokens / wall over the rounds."""
    with Counted(engine) as c:
        runs = [timed(engine, ps, loras, out_len) for _ in range(rounds)]
    wall = sum(r["wall_s"] for r in runs)
    out = sum(r["output_tokens"] for r in runs)
    return c.into({
        "requests": len(ps), "rounds": rounds, "output_tokens": out, "wall_s": wall,
        "output_tok_s": out / wall, "round_output_tok_s": [r["output_tok_s"] for r in runs],
        "ttft_median_ms": runs[-1]["ttft_median_ms"],
        "tpot_median_ms": runs[-1]["tpot_median_ms"],
        "output_tokens_min": min(r["output_tokens_min"] for r in runs),
        "output_tokens_max": max(r["output_tokens_max"] for r in runs),
        "tokens": runs[-1]["tokens"]})


def engine_kwargs(a: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"load_format": "dummy", "device": a.device, "dtype": a.dtype,
                          **(json.loads(a.engine_extra) if a.engine_extra else {}), **extra}
    if a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    if a.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    return kw


def bench_engine(model_dir: str, a: argparse.Namespace, adapters: dict[str, str] | None,
                 **extra: Any) -> dict[str, Any]:
    """One engine (LoRA on when `adapters` is given): its plan, warm-up, measurements."""
    from core import Engine

    if adapters:
        extra.update(enable_lora=True, lora_paths=[f"{n}={p}" for n, p in adapters.items()],
                     max_loras_per_batch=len(adapters), max_lora_rank=a.lora_rank,
                     lora_backend=a.lora_backend)
    vocab = a.cfg["vocab_size"]
    names = list(adapters or ())
    b1 = prompts(a.batch1_requests, a.input_len, vocab, 3)
    conc = prompts(a.concurrent, a.input_len, vocab, 5)
    b1_loras = [names[i % len(names)] for i in range(len(b1))] if names else None
    conc_loras = [names[i % len(names)] for i in range(len(conc))] if names else None
    t = time.perf_counter()
    with Engine(model_dir, **engine_kwargs(a, **extra)) as engine:
        res: dict[str, Any] = {
            "startup_s": time.perf_counter() - t, "lora_backend": engine.plan.lora_backend,
            "cuda_graph": engine.plan.cuda_graph,
            "cuda_graph_batch_sizes": list(engine.info.cuda_graph_batch_sizes),
            "max_running_requests": engine.info.max_running_requests,
            "pool_tokens": engine.info.pool_tokens,
            "graph_notes": [n for n in dict.fromkeys((*engine.plan.notes, *engine.info.notes))
                            if "graph" in n]}
        # warm-up: every kind of request at these prompt lengths and batch sizes, every
        # adapter into its slot
        t = time.perf_counter()
        warm = prompts(max(a.concurrent, 1), a.input_len, vocab, 1)
        for loras in [None, conc_loras] if names else [None]:
            timed(engine, warm[:1], [loras[0] if loras else None], WARMUP_TOKENS)
            timed(engine, warm, loras or [None] * len(warm), WARMUP_TOKENS)
        res["warmup_s"] = time.perf_counter() - t
        res["batch1_base"] = batch1(engine, b1, [None] * len(b1), a.output_len)
        if names:
            res["batch1_lora"] = batch1(engine, b1, b1_loras, a.output_len)
        res["concurrent_base"] = concurrent(engine, conc, [None] * len(conc), a.output_len,
                                            a.rounds)
        if names:
            res["concurrent_lora"] = concurrent(engine, conc, conc_loras, a.output_len,
                                                a.rounds)
        stats = engine.stats()
        res["lora_slot_loads"] = stats.get("lora_slot_loads")
        res["retractions"] = stats.get("retractions")
    return res


def same_tokens(x: list[list[int]], y: list[list[int]]) -> int:
    return sum(p == q for p, q in zip(x, y, strict=True))


def check_and_summarize(report: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Ratios against the base engine, the checks, and the tokens dropped from the JSON."""
    base, lora = report.get("base") or {}, report.get("lora") or {}
    eager = report.get("base_eager") or {}
    checks: dict[str, Any] = {}
    failed: list[str] = []
    for eng_name, eng in (("base", base), ("lora", lora), ("base_eager", eager)):
        for key, res in eng.items():
            if isinstance(res, dict) and "output_tokens_min" in res:
                if not res["output_tokens_min"] == res["output_tokens_max"] == a.output_len:
                    failed.append(f"{eng_name} {key}: output lengths {res['output_tokens_min']}"
                                  f"..{res['output_tokens_max']}, not {a.output_len}")
    for case in ("batch1", "concurrent"):
        b, lb, ll = (base.get(f"{case}_base"), lora.get(f"{case}_base"),
                     lora.get(f"{case}_lora"))
        if b and ll:
            differ = len(b["tokens"]) - same_tokens(b["tokens"], ll["tokens"])
            checks[f"{case}_adapter_requests_differing_from_base"] = (
                f"{differ}/{len(b['tokens'])}")
            if differ == 0:
                failed.append(f"{case}: every adapter request gave the base model's tokens "
                              "(no delta applied?)")
        if b and lb:
            checks[f"{case}_lora_engine_base_requests_equal_to_base"] = (
                f"{same_tokens(b['tokens'], lb['tokens'])}/{len(b['tokens'])}")
    s: dict[str, Any] = {}
    for case, metric in (("batch1", "decode_tok_s"), ("batch1", "output_tok_s"),
                         ("concurrent", "output_tok_s")):
        ref = (base.get(f"{case}_base") or {}).get(metric)
        for eng_name, eng, kind in (("lora", lora, "base"), ("lora", lora, "lora"),
                                    ("base_eager", eager, "base")):
            got = (eng.get(f"{case}_{kind}") or {}).get(metric)
            s[f"{case}_{metric}_{eng_name}_{kind}_vs_base"] = ratio(got, ref)
        if eager:
            got = (lora.get(f"{case}_lora") or {}).get(metric)
            s[f"{case}_{metric}_lora_lora_vs_base_eager"] = ratio(
                got, (eager.get(f"{case}_base") or {}).get(metric))
    for case, target in TARGETS.items():
        metric = "decode_tok_s" if case == "batch1" else "output_tok_s"
        got = s.get(f"{case}_{metric}_lora_lora_vs_base")
        s[f"{case}_target"] = target
        s[f"{case}_meets_target"] = None if got is None else got >= target
    for eng in (base, lora, eager):  # per-request tokens: used above, too long to keep
        for res in eng.values():
            if isinstance(res, dict):
                res.pop("tokens", None)
    report["checks"] = {**checks, "failed": failed}
    return s


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(report: dict[str, Any], a: argparse.Namespace) -> str:
    """The markdown table of the report: one row per engine and kind of request."""
    base, lora = report.get("base") or {}, report.get("lora") or {}
    eager = report.get("base_eager") or {}
    n = a.num_adapters
    head = (f"{report['device']}, {a.dtype}, {Path(a.config).name if a.config else 'tiny Llama'}"
            f", {n} adapters of rank {a.lora_rank} on q,k,v,o,gate,up,down, LoRA backend "
            f"{lora.get('lora_backend', '?')}, input {a.input_len}, output {a.output_len}")
    lines = [head, "",
             "| case | engine | requests | decode tok/s | output tok/s | vs base | target | "
             "decode steps from graphs |", "|---|---|---|---|---|---|---|---|"]
    rows = [("batch 1", "base", base, "batch1_base", None),
            ("batch 1", "LoRA on, base requests", lora, "batch1_base", None),
            ("batch 1", f"LoRA on, {n} adapters", lora, "batch1_lora", "batch1"),
            ("batch 1", "base, no graphs", eager, "batch1_base", None),
            (f"{a.concurrent} concurrent", "base", base, "concurrent_base", None),
            (f"{a.concurrent} concurrent", "LoRA on, base requests", lora, "concurrent_base",
             None),
            (f"{a.concurrent} concurrent", f"LoRA on, {n} adapters", lora, "concurrent_lora",
             "concurrent"),
            (f"{a.concurrent} concurrent", "base, no graphs", eager, "concurrent_base", None)]
    for case, label, eng, key, target in rows:
        res = eng.get(key)
        if not res:
            continue
        ref = base.get(key.replace("_lora", "_base")) or {}
        metric = "decode_tok_s" if key.startswith("batch1") else "output_tok_s"
        r = ratio(res.get(metric), ref.get(metric))
        goal = "-"
        if target is not None:
            met = r is not None and r >= TARGETS[target]
            goal = f">= {TARGETS[target]} ({'met' if met else 'not met'})"
        lines.append(f"| {case} | {label} | {res['requests']} | {_fmt(res.get('decode_tok_s'))} "
                     f"| {_fmt(res.get('output_tok_s'))} | {_fmt(r, 3)} | {goal} | "
                     f"{res['graph_replays']}/{res['decode_steps']} |")
    lines += ["", "vs base: batch 1 on decode tok/s, concurrent on output tok/s, against the "
              "base engine's same case in this run."]
    if eager:
        s = report.get("summary") or {}
        lines.append("adapter requests vs the base without graphs (the graphs' gain against "
                     "the delta's cost): batch 1 "
                     f"{_fmt(s.get('batch1_decode_tok_s_lora_lora_vs_base_eager'), 3)}, "
                     "concurrent "
                     f"{_fmt(s.get('concurrent_output_tok_s_lora_lora_vs_base_eager'), 3)}")
    lines += [f"graphs ({name}): {'; '.join(eng.get('graph_notes') or ['-'])}"
              for name, eng in (("base", base), ("lora", lora)) if eng]
    lines += [f"check: {k} {v}" for k, v in report["checks"].items() if k != "failed"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--config", default=None,
                   help=f"HF config.json of a Llama-shaped model (default: {DEFAULT_CONFIG.name}"
                        " on cuda, a tiny random Llama on cpu)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (cuda), float32 (cpu)")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0, help="scaling = alpha / rank")
    p.add_argument("--lora-backend", default="auto",
                   help="--lora-backend of the LoRA engine (default: the resolver's choice)")
    p.add_argument("--input-len", type=int, default=None, help="default 128 (cuda), 16 (cpu)")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (cuda), 8 (cpu)")
    p.add_argument("--batch1-requests", type=int, default=None,
                   help="batch-1 requests of each kind, one after the other (default 4 / 2)")
    p.add_argument("--concurrent", type=int, default=None,
                   help="requests submitted at once (default 64 / 8)")
    p.add_argument("--rounds", type=int, default=1, help="concurrent rounds of each kind")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="every engine without CUDA graphs (no base_eager engine then)")
    p.add_argument("--skip-eager-base", action="store_true",
                   help="no extra base engine without CUDA graphs")
    p.add_argument("--engine-extra", default=None,
                   help="more core.Engine flags for every engine, as JSON")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    for k, (g_val, c_val) in DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, g_val if gpu else c_val)
    for flag in ("num_adapters", "lora_rank", "output_len", "input_len", "batch1_requests",
                 "concurrent", "rounds"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if a.output_len < 2:
        p.error("--output-len must be >= 2 (decode tokens/s needs two tokens)")
    if a.config is None and gpu:
        a.config = str(DEFAULT_CONFIG)
    a.cfg = json.loads(Path(a.config).read_text()) if a.config else dict(TINY)
    a.eager_base = not a.disable_cuda_graph and not a.skip_eager_base  # CPUs have graphs too
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("skipped: --device cuda needs CUDA (try --device cpu)")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: engines stop too
    report = new_report(a, gpu)
    run = Stages(report, a.out, gpu)  # saved after every engine; a broken one loses no other
    save, errors, stages = run.save, run.failed, report["stage_wall_s"]

    def stage(name: str, *args: Any, **kw: Any) -> None:
        report[name] = run(name, bench_engine, *args, **kw)
        save()

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lora_serving_") as tmp:
        model_dir = make_model_dir(a.cfg, Path(tmp) / "model")
        t = time.perf_counter()
        adapters = write_adapters(a.cfg, Path(tmp) / "adapters", a.num_adapters, a.lora_rank,
                                  a.lora_alpha, getattr(torch, a.dtype))
        stages["write_adapters"] = round(time.perf_counter() - t, 1)
        # what matters most first (the two targets need base and lora), so a run cut short
        # keeps it
        stage("base", model_dir, a, None)
        stage("lora", model_dir, a, adapters)
        if a.eager_base:
            stage("base_eager", model_dir, a, None, disable_cuda_graph=True)
    stages["total"] = round(time.perf_counter() - t0, 1)
    report["summary"] = check_and_summarize(report, a)
    report["failed_stages"] = errors
    save()
    print(json.dumps(jsonable(report), indent=2, default=str))
    print()
    print(table(report, a))
    failed = report["checks"]["failed"]
    for f in failed:
        print(f"check failed: {f}")
    if errors:
        print(f"failed engines: {', '.join(errors)} (see their 'error' in the JSON)")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
