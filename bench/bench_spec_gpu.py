"""Speculative decoding with forced acceptance, against speculation off in the same run (issue
33's H200 table).

    python bench/bench_spec_gpu.py --out spec_gpu.json        # CUDA: Llama-3.1-8B shapes, fp32
    python bench/bench_spec_gpu.py --cases b1,b16 --num-prompts b1=8
    python bench/bench_spec_gpu.py --device cpu               # a tiny random Llama, fp32, seconds

The model is a config (--config, default tests/fixtures/configs/llama-3.1-8b.json; on the CPU
bench_serving.py's tiny Llama) served with --load-format dummy and a word-level tokenizer over
the whole vocabulary (bench_serving.make_model_dir). Prompts are random token ids (fixed seeds,
--input-len); every request is greedy with ignore_eos and --output-len new tokens, so lengths
are fixed and on / off do the same work.

Run 1, speculation off (one engine): every case's prompts (and its warm-up prompts), timed and
their greedy outputs recorded. Then, per speculative engine, the same prompts again:
- b1: one request at a time, the bench-only oracle proposer (bench/spec_oracle.py: replays
  run 1's greedy continuation, --draft-tokens drafts; acceptance is forced, not hoped for);
- b16: 16 requests submitted at once (groups of 16), the oracle;
- c64: 64 at once, the oracle with --speculative-governor on (the governor must not lose at
  high load);
- draft: one at a time, the `standalone` proposer (SGLang's STANDALONE) with the target's own
  config as its draft, quantized at load (--draft-quantization, default fp8). Dummy weights are
  drawn per parameter name from the engine's seed for target and draft alike, so the draft is
  the target's weights rounded by its quantization: its acceptance is measured, whatever it is.
Every engine first runs a warm-up of the case's shape (its own prompts, recorded too, fewer new
tokens) outside the timing.

Figures per case (over the prompts both runs completed): tokens/s off and with speculation and
their ratio: decode tok/s (tokens after the first / first-to-last token seconds, summed over
requests) for the one-at-a-time cases, output tok/s (tokens / wall seconds of the groups) for
the concurrent ones; acceptance = accepted / drafted and tokens per verify step = 1 + accepted
/ verify steps with drafts (each request's meta_info counters; the engine's spec_* counters
beside them); the step cost: a plain step's mean time (run 1: decode seconds / decode tokens)
and a verify step's, from each request's decode time once its plain steps (decode tokens -
verify steps - accepted) are charged at run 1's rate (bench_spec_cpu.py's estimate; for the
concurrent cases a request's step is the batch's step). The issue's ideal at batch 1: 5 tokens
per step costing at most 1.15x a plain step.

Greedy outputs with speculation must equal run 1's token for token: a mismatch is listed (case,
prompt, first differing token) and makes the exit code 1, as a failed stage does. The JSON
(--out) is written after every stage, so a run cut short keeps what it measured; token ids are
left out of it.

--device cpu is the functional check (tests/test_bench_spec_gpu.py runs it): the tiny model's
figures say nothing about the GPU, and its workers run --threads torch threads (default 1) so
that they and this process do not fight over a small machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO)):  # bench this checkout, whatever else is installed
    if _p not in sys.path:
        sys.path.insert(0, _p)

import spec_oracle  # noqa: E402
from bench_serving import TINY, make_model_dir, prompts  # noqa: E402
from cli_lists import choice_list  # noqa: E402
from serving_report import jsonable  # noqa: E402
from stages import Stages, new_report  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    concurrency: int  # 1: one request at a time
    engine: str  # which speculative engine runs it (SPEC_ENGINES)
    seed: int  # of its prompts (its warm-up prompts: seed + 1000)
    target: float | None  # issue 33's tokens/s ratio on the H200, None: reported only
    what: str


CASES = {c.name: c for c in (
    Case("b1", 1, "oracle", 101, 3.5, "one request at a time, oracle"),
    Case("b16", 16, "oracle", 102, 1.5, "16 at once, oracle"),
    Case("draft", 1, "draft", 103, None, "one at a time, the target as its own quantized draft"),
    Case("c64", 64, "oracle_governor", 104, 0.95, "64 at once, oracle, governor on"),
)}
SPEC_ENGINES = ("oracle", "oracle_governor", "draft")  # started in this order
STEP_IDEAL = 1.15  # issue 33: 5 tokens per step costing at most this times a plain step
DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
# (cuda, cpu) defaults of the flags left unset
# (cuda, cpu). fp32 on the GPU too: in bf16 the verify forward and the graph-replayed decode
# round differently, and random dummy logits are full of near-ties, so greedy outputs leave the
# recording within tens of tokens and the oracle stops drafting (the H100 run of session 23,
# bench/RESULTS.md). The warm-up runs enough verify steps to compile the extend kernels'
# specialisations before anything is timed.
DEFAULTS = {"dtype": ("float32", "float32"), "input_len": (256, 32), "output_len": (256, 32),
            "warmup_output_len": (96, 4), "max_total_tokens": (None, 16384),
            "draft_quantization": ("fp8", "fp8"), "case_budget_s": (90.0, 120.0)}
DEFAULT_PROMPTS = {"cuda": {"b1": 4, "b16": 32, "draft": 4, "c64": 64},
                   "cpu": {"b1": 2, "b16": 16, "draft": 2, "c64": 64}}
META = ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens", "spec_note")
COUNTERS = ("spec_verify_steps", "spec_num_drafts", "spec_num_draft_tokens",
            "spec_num_accepted_tokens", "spec_governor_cut", "spec_graph_cut", "decode_tokens",
            "retractions", "spec_draft_forwards")


# -- the oracle's registration (this process and the engine workers it spawns) ---------------------

def oracle_site(tmp: Path, recording: Path) -> Path:
    """A throw-away site folder holding only a dist-info whose `core.plugins` entry point is
    bench/spec_oracle.py, put on sys.path (engine workers are spawned with this sys.path, so
    they find it as a third party's plugin), and $BENCH_SPEC_ORACLE_FILE set to `recording`.
    Nothing is installed: the entry point lives as long as `tmp`."""
    site = tmp / "oracle_site"
    info = site / "bench_spec_oracle-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-spec-oracle\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        f"[core.plugins]\n{spec_oracle.ENTRY_POINT} = spec_oracle\n")
    sys.path.insert(0, str(site))
    os.environ[spec_oracle.FILE_ENV] = str(recording)
    from core.plan.registry import get_registry

    reg = get_registry(reload=True)
    if reg.get("spec", spec_oracle.NAME) is None:
        raise RuntimeError(f"the {spec_oracle.NAME} proposer did not register (filtered by "
                           "CORE_PLUGINS_ALLOW / CORE_PLUGINS_DENY?): "
                           f"{[f.error for f in reg.failures]}")
    return site


# -- running requests -----------------------------------------------------------------------------

def run_group(engine: Any, batch: list[list[int]], out_len: int) -> dict[str, Any]:
    """Submit `batch` at once and stream it; per request: its output ids, first / last token
    times and its speculation counters."""
    sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    n = len(batch)
    reqs: list[dict[str, Any]] = [{"output_ids": [], "first": None, "last": None}
                                  for _ in range(n)]
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=batch, sampling_params=sp, stream=True):
        now = time.perf_counter()
        r = reqs[chunk["index"] if n > 1 else 0]
        if chunk["token_ids"]:
            r["first"] = r["first"] or now
            r["last"] = now
            r["output_ids"] += chunk["token_ids"]
        if chunk["finish_reason"] is not None:
            meta = chunk.get("meta_info") or {}
            r.update({k: meta[k] for k in META if k in meta})
    wall = time.perf_counter() - t0
    for r in reqs:
        first, last = r.pop("first"), r.pop("last")
        r["tokens"] = len(r["output_ids"])
        r["ttft_s"] = None if first is None else first - t0
        r["decode_s"] = 0.0 if first is None else last - first
    return {"wall_s": wall, "requests": reqs}


def groups(batch: list[list[int]], size: int) -> list[list[list[int]]]:
    return [batch[i:i + size] for i in range(0, len(batch), size)]


def counters(engine: Any) -> dict[str, Any]:
    s = engine.stats()
    out = {k: s[k] for k in COUNTERS if k in s}
    out["forward_count"] = dict(s.get("forward_count") or {})
    return out


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
    fc0 = before.get("forward_count", {})
    out["forward_count"] = {k: v - fc0.get(k, 0) for k, v in after["forward_count"].items()}
    return out


def measure(engine: Any, case: Case, work: dict[str, Any], a: argparse.Namespace,
            n_groups: int | None = None) -> dict[str, Any]:
    """A warm-up group, then the case's groups (at most n_groups), stopping early once the
    measured part has taken --case-budget-s; the engine's counters over the measured part."""
    warm = run_group(engine, work["warmup"], a.warmup_output_len)
    todo = groups(work["prompts"], case.concurrency)[:n_groups]
    c0, t0, done = counters(engine), time.perf_counter(), []
    for g in todo:
        done.append(run_group(engine, g, a.output_len))
        if time.perf_counter() - t0 > a.case_budget_s and len(done) < len(todo):
            print(f"  {case.name}: --case-budget-s {a.case_budget_s:.0f} s spent after "
                  f"{len(done)} of {len(todo)} groups", flush=True)
            break
    return {"groups": done, "cut": len(done) < len(todo), "counters": delta(c0, counters(engine)),
            "warmup_outputs": [r["output_ids"] for r in warm["requests"]]}


# -- engines --------------------------------------------------------------------------------------

def engine_kwargs(a: argparse.Namespace, model_dir: str, kind: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"load_format": "dummy", "device": a.device, "dtype": a.dtype,
                          **(json.loads(a.engine_extra) if a.engine_extra else {})}
    if a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    if kind == "off":
        return kw
    kw["speculative_num_draft_tokens"] = a.draft_tokens
    if kind == "draft":
        kw.update(speculative_algorithm="standalone", speculative_draft_model_path=model_dir,
                  speculative_draft_load_format="dummy")
        if a.draft_quantization != "none":
            kw["speculative_draft_model_quantization"] = a.draft_quantization
        return kw
    kw["speculative_algorithm"] = spec_oracle.NAME
    kw["speculative_governor"] = "on" if kind == "oracle_governor" else "off"
    return kw


def run_engine(model_dir: str, kind: str, cases: list[Case], work: dict[str, dict[str, Any]],
               a: argparse.Namespace, limits: dict[str, int] | None = None) -> dict[str, Any]:
    """One engine (speculation off, or one speculative kind) over its cases."""
    import core

    t = time.perf_counter()
    with core.Engine(model_dir, **engine_kwargs(a, model_dir, kind)) as engine:
        res: dict[str, Any] = {"startup_s": time.perf_counter() - t,
                               "notes": list(engine.plan.notes) + list(engine.info.notes),
                               "decode_attention": engine.plan.decode_attention,
                               "spec_proposer": engine.plan.spec_proposer, "cases": {}}
        for c in cases:
            print(f"--- {kind}: {c.name}", flush=True)
            res["cases"][c.name] = measure(engine, c, work[c.name], a,
                                           None if limits is None else limits.get(c.name))
    return res


# -- figures --------------------------------------------------------------------------------------

def public(report: dict[str, Any]) -> Any:
    """The report as JSON holds it: token ids left out (the figures and mismatches say what
    they showed), inf / nan as strings."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("output_ids",
                                                                     "warmup_outputs")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return jsonable(strip(report))


def _sum(reqs: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key) or 0 for r in reqs)


def case_figures(case: Case, off: dict[str, Any], on: dict[str, Any], output_len: int, k: int
                 ) -> dict[str, Any]:
    """Off against speculation over the groups both completed."""
    n = min(len(off["groups"]), len(on["groups"]))
    f: dict[str, Any] = {"case": case.name, "concurrency": case.concurrency, "groups": n,
                         "what": case.what, "target": case.target}
    for side, run in (("off", off), ("spec", on)):
        gs = run["groups"][:n]
        reqs = [r for g in gs for r in g["requests"]]
        tokens = _sum(reqs, "tokens")
        dec_tokens = sum(max(r["tokens"] - 1, 0) for r in reqs)
        dec_s, wall = _sum(reqs, "decode_s"), sum(g["wall_s"] for g in gs)
        f[side] = {"requests": len(reqs), "tokens": tokens, "wall_s": wall,
                   "output_tok_s": tokens / wall if wall else None,
                   "decode_tokens": dec_tokens, "decode_s": dec_s,
                   "decode_tok_s": dec_tokens / dec_s if dec_s else None}
    f["rate"] = "decode" if case.concurrency == 1 else "output"
    key = f"{f['rate']}_tok_s"
    f["tok_s_off"], f["tok_s_spec"] = f["off"][key], f["spec"][key]
    f["ratio"] = f["tok_s_spec"] / f["tok_s_off"] if f["tok_s_off"] and f["tok_s_spec"] \
        else None
    reqs = [r for g in on["groups"][:n] for r in g["requests"]]
    drafted, acc = _sum(reqs, "spec_draft_tokens"), _sum(reqs, "spec_accepted_tokens")
    verify = _sum(reqs, "spec_verify_ct")
    f.update(drafted=drafted, accepted=acc, verify_steps=verify,
             acceptance=acc / drafted if drafted else None,
             tokens_per_verify_step=1 + acc / verify if verify else None,
             spec_notes=sorted({r["spec_note"] for r in reqs if r.get("spec_note")}))
    f["ideal_tokens_per_verify_step"] = ideal_tokens_per_verify_step(output_len, k)
    f["engine_counters"] = on["counters"]
    # the step cost (module doc): plain steps at run 1's rate, the rest of the decode time is
    # the verify steps'
    dec_off, s_off = f["off"]["decode_tokens"], f["off"]["decode_s"]
    if dec_off and s_off:
        plain_s = s_off / dec_off
        f["plain_step_ms"] = 1e3 * plain_s
        if verify:
            plain = max(f["spec"]["decode_tokens"] - verify - acc, 0)
            verify_s = (f["spec"]["decode_s"] - plain * plain_s) / verify
            f.update(plain_steps=plain, verify_step_ms=1e3 * verify_s,
                     verify_vs_plain=verify_s / plain_s)
    return f


def mismatches(case: str, off: dict[str, Any], on: dict[str, Any]) -> list[str]:
    """Requests whose greedy output with speculation differs from run 1's."""
    out = []
    for gi, (g0, g1) in enumerate(zip(off["groups"], on["groups"], strict=False)):
        for ri, (want, got) in enumerate(zip(g0["requests"], g1["requests"], strict=True)):
            a, b = want["output_ids"], got["output_ids"]
            if a != b:
                at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                          min(len(a), len(b)))
                out.append(f"{case} group {gi} request {ri}: differs from speculation off at "
                           f"token {at} ({len(a)} vs {len(b)} tokens)")
    return out


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(figs: dict[str, dict[str, Any]], bad: dict[str, list[str]]) -> str:
    lines = ["| case | requests x concurrency | tok/s off | tok/s spec | spec / off | target | "
             "acceptance | tokens / verify step (all accepted) | plain step ms | "
             "verify step ms | verify / plain step | outputs = off |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in figs.items():
        lines.append(
            f"| {name} ({f['what']}; {f['rate']} tok/s) | {f['spec']['requests']} x "
            f"{f['concurrency']} | {_num(f['tok_s_off'])} | {_num(f['tok_s_spec'])} | "
            f"{_num(f['ratio'], '{:.2f}x')} | {_num(f['target'], '>= {:.2f}x')} | "
            f"{_num(f['acceptance'], '{:.3f}')} | {_num(f['tokens_per_verify_step'], '{:.2f}')} "
            f"({_num(f['ideal_tokens_per_verify_step'], '{:.2f}')}) | "
            f"{_num(f.get('plain_step_ms'), '{:.2f}')} | "
            f"{_num(f.get('verify_step_ms'), '{:.2f}')} | "
            f"{_num(f.get('verify_vs_plain'), '{:.2f}x')} | "
            f"{'yes' if not bad.get(name) else f'NO ({len(bad[name])})'} |")
    return "\n".join(lines)


def targets(figs: dict[str, dict[str, Any]], k: int) -> list[str]:
    """Issue 33's H200 targets, each met or missed, from this run's figures."""
    out = []
    for name, f in figs.items():
        if f["target"] is not None and f["ratio"] is not None:
            out.append(f"{name}: spec / off = {f['ratio']:.2f}x (target >= {f['target']}x): "
                       f"{'met' if f['ratio'] >= f['target'] else 'missed'}")
        elif name == "draft":
            out.append(f"draft: acceptance {_num(f['acceptance'], '{:.3f}')}, "
                       f"{_num(f['tokens_per_verify_step'], '{:.2f}')} tokens per verify step, "
                       f"spec / off = {_num(f['ratio'], '{:.2f}x')} (reported, no target)")
    b1 = figs.get("b1")
    if b1 and b1.get("verify_vs_plain") is not None:
        tps, cost = b1["tokens_per_verify_step"], b1["verify_vs_plain"]
        ideal = b1["ideal_tokens_per_verify_step"] or k + 1
        out.append(f"b1 step: {tps:.2f} tokens per verify step (every draft accepted: "
                   f"{ideal:.2f}; {k + 1} but for a request's last steps) costing "
                   f"{cost:.2f}x a plain step (ideal <= {STEP_IDEAL}x): "
                   f"{'met' if cost <= STEP_IDEAL and tps >= ideal - 0.01 else 'missed'}")
    return out


def ideal_tokens_per_verify_step(output_len: int, k: int) -> float | None:
    """Tokens per verify step of a request whose every draft is accepted: the scheduler asks
    for min(k, left - 1) drafts (its last token is always the target's), so the last steps
    of a request carry fewer, and a plain step ends it when one token is left."""
    emitted, steps, tokens = 1, 0, 0  # the prefill gave the first token
    while emitted < output_len:
        drafts = min(k, output_len - emitted - 1)
        if drafts:
            steps, tokens = steps + 1, tokens + drafts + 1
        emitted += drafts + 1
    return tokens / steps if steps else None


# -- main -----------------------------------------------------------------------------------------

def parse_num_prompts(p: argparse.ArgumentParser, text: str | None, device: str
                      ) -> dict[str, int]:
    got = dict(DEFAULT_PROMPTS[device])
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in CASES or not value.strip().isdigit():
            p.error(f"--num-prompts: expected CASE=N items (cases {', '.join(CASES)}), got "
                    f"{item!r}")
        got[name] = int(value)
    for name, n in got.items():
        c = CASES[name].concurrency
        if n < c or n % c:
            p.error(f"--num-prompts {name}={n}: a positive multiple of its concurrency {c}")
    return got


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--config", default=None,
                   help=f"an HF config.json (default: {DEFAULT_CONFIG.relative_to(REPO)} on "
                        "cuda, bench_serving.py's tiny Llama on cpu)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--num-prompts", default=None,
                   help="per case, e.g. b1=8,c64=128 (a multiple of the case's concurrency); "
                        "defaults: " + "; ".join(f"{d}: " + ",".join(f"{k}={v}" for k, v in
                                                                     n.items())
                                                 for d, n in DEFAULT_PROMPTS.items()))
    p.add_argument("--input-len", type=int, default=None, help="default 256 (cpu 32)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (cpu 32)")
    p.add_argument("--warmup-output-len", type=int, default=None, help="default 16 (cpu 4)")
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="--speculative-num-draft-tokens of every speculative engine")
    p.add_argument("--draft-quantization", default=None,
                   help="the draft case's --speculative-draft-model-quantization (default fp8; "
                        "none: the draft unquantized, the target's own weights)")
    p.add_argument("--dtype", default=None,
                   help="default float32 (bf16 greedy outputs depart from the recording on "
                        "dummy weights: see DEFAULTS)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="default: the engine's (cpu 16384)")
    p.add_argument("--case-budget-s", type=float, default=None,
                   help="stop a case's measured groups once they took this long (default 90, "
                        "cpu 120); the ratios cover the groups both runs completed")
    p.add_argument("--engine-extra", default=None,
                   help='more core.Engine flags for every engine, as JSON '
                        '(e.g. \'{"cuda_graph_max_bs": 64}\')')
    p.add_argument("--threads", type=int, default=1,
                   help="cpu: the engine workers' torch threads (OMP_NUM_THREADS; default 1: "
                        "the worker and this process do not fight over a small machine's "
                        "cores)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    a.cases = choice_list(p, "--cases", a.cases, tuple(CASES))
    d = 0 if a.device == "cuda" else 1
    for name, values in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, values[d])
    a.num_prompts = parse_num_prompts(p, a.num_prompts, a.device)
    for name in ("input_len", "output_len", "warmup_output_len", "draft_tokens", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.output_len < 2:
        p.error("--output-len must be >= 2 (a decode phase to time)")
    if a.engine_extra:
        try:
            json.loads(a.engine_extra)
        except ValueError as exc:
            p.error(f"--engine-extra: not JSON ({exc})")
    if a.config:
        a.cfg = json.loads(Path(a.config).read_text())
    else:
        a.cfg = json.loads(DEFAULT_CONFIG.read_text()) if a.device == "cuda" else dict(TINY)
    return a


def workload(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each selected case's prompts and warm-up prompts."""
    vocab = a.cfg["vocab_size"]
    return {name: {"prompts": prompts(a.num_prompts[name], a.input_len, vocab, c.seed),
                   "warmup": prompts(c.concurrency, a.input_len, vocab, c.seed + 1000)}
            for name, c in CASES.items() if name in a.cases}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda needs CUDA (try --device cpu)")
        return 0
    if a.device == "cpu":  # read by the engine workers' torch when they start
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    # `timeout` and schedulers stop us with SIGTERM: unwind, so the engines stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = [CASES[n] for n in CASES if n in a.cases]  # the table's order
    work = workload(a)
    report = new_report(a, a.device == "cuda")
    report.update(command=" ".join([Path(sys.executable).name, *sys.argv]),
                  model={k: a.cfg.get(k) for k in ("architectures", "hidden_size",
                                                   "num_hidden_layers", "vocab_size")},
                  loadavg_1m=round(os.getloadavg()[0], 2), runs={})
    run = Stages(report, a.out, a.device == "cuda", public)
    failed = run.failed

    def stage(name: str, fn: Any, *args: Any, **kw: Any) -> dict[str, Any] | None:
        """fn's result, or None when it raised (its error then in report["runs"])."""
        res = run(name, fn, *args, **kw)
        if name in failed:
            report["runs"][name] = res
            run.save()
            return None
        return res

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_spec_gpu_") as tmp:
        model_dir = make_model_dir(a.cfg, Path(tmp) / "model")
        recording = Path(tmp) / "recording.json"
        oracle_site(Path(tmp), recording)
        off = stage("off", run_engine, model_dir, "off", cases, work, a)
        if off is not None:
            report["runs"]["off"] = off
            # run 1's greedy outputs, warm-up prompts included, for the oracle to replay
            pairs = []
            for c in cases:
                w, res = work[c.name], off["cases"][c.name]
                done = [r["output_ids"] for g in res["groups"] for r in g["requests"]]
                pairs += list(zip(w["prompts"], done, strict=False))
                pairs += list(zip(w["warmup"], res["warmup_outputs"], strict=True))
            spec_oracle.write_recording(recording, pairs)
            limits = {c.name: len(off["cases"][c.name]["groups"]) for c in cases}
            for kind in SPEC_ENGINES:
                mine = [c for c in cases if c.engine == kind]
                if mine:
                    res = stage(kind, run_engine, model_dir, kind, mine, work, a, limits)
                    if res is not None:
                        report["runs"][kind] = res
    report["stage_wall_s"]["total"] = round(time.perf_counter() - t_start, 1)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return finish(report, cases, a, failed)


def finish(report: dict[str, Any], cases: list[Case], a: argparse.Namespace,
           failed: list[str]) -> int:
    runs = report["runs"]
    figs: dict[str, dict[str, Any]] = {}
    bad: dict[str, list[str]] = {}
    for c in cases:
        off = (runs.get("off") or {}).get("cases", {}).get(c.name)
        on = (runs.get(c.engine) or {}).get("cases", {}).get(c.name)
        if off is None or on is None:
            continue
        figs[c.name] = case_figures(c, off, on, a.output_len, a.draft_tokens)
        bad[c.name] = mismatches(c.name, off, on)
    report["figures"] = figs
    report["mismatches"] = [m for ms in bad.values() for m in ms]
    report["targets"] = targets(figs, a.draft_tokens)
    report["table"] = markdown_table(figs, bad)
    notes = []
    for kind, res in runs.items():
        if "error" in res:
            notes.append(f"{kind} failed: {res['error'][:400]}")
            continue
        notes.append(f"{kind}: startup {res['startup_s']:.1f} s, decode attention "
                     f"{res['decode_attention']}, proposer {res['spec_proposer'] or 'none'}")
        notes += [f"{kind}: {n}" for n in res["notes"]
                  if any(w in n for w in ("specul", "proposer", "draft", "overlap", "oracle"))]
        for name, r in res["cases"].items():
            if r["cut"]:
                notes.append(f"{kind} {name}: cut by --case-budget-s after "
                             f"{len(r['groups'])} groups")
    if "draft" in figs:
        q = a.draft_quantization
        notes.append("draft: the target's config, dummy weights drawn from the same seed per "
                     "parameter name as the target's, so the draft is the target's weights "
                     + ("exactly (--draft-quantization none)" if q == "none" else
                        f"quantized at load ({q})")
                     + "; its acceptance is measured, not forced; its verify step time "
                     "includes the draft model's forwards")
    if a.device == "cpu" or a.config:
        notes.append("the targets are issue 33's for the H200 at Llama-3.1-8B shapes; on "
                     "this model / device they are only a reading")
    report["notes"] = notes
    report["failed_stages"] = failed
    if a.out:
        Path(a.out).write_text(json.dumps(public(report), indent=2, default=str))
    w = report["args"]
    print(f"\n{report['date']}: {report['device']}, torch {report['torch']}; "
          f"{report['model']['num_hidden_layers']} layers x {report['model']['hidden_size']}, "
          f"{w['dtype']}, dummy weights; {w['input_len']} in / {w['output_len']} out, greedy, "
          f"ignore_eos; {w['draft_tokens']} draft tokens; load {report['loadavg_1m']} -> "
          f"{report.get('loadavg_1m_end')}; {report['stage_wall_s'].get('total')} s\n")
    print(report["table"] + "\n")
    for line in report["targets"] + notes:
        print(f"- {line}")
    if report["mismatches"]:
        print("\nGREEDY MISMATCH (speculation changed the outputs):")
        for line in report["mismatches"]:
            print(f"- {line}")
    if a.out:
        print(f"\nwritten to {a.out}")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (see the JSON)")
    return 1 if failed or report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
