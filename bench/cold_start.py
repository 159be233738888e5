"""`core serve` from a fresh process to its first served token, phase by phase (issue 37 item 5).

    python bench/cold_start.py --out cold_start.json                 # a GPU: Llama-3.1-8B, dummy
    python bench/cold_start.py --config tests/fixtures/configs/deepseek-v2-lite.json
    python bench/cold_start.py --device cpu                          # the default GGUF model

Each run starts `core serve` in a fresh process (bench/serving_online.ServerProcess), waits for
/health to answer 200 (`ready`), sends one greedy /generate request of one token and reads
/get_server_info. The first run gets empty caches (TRITON_CACHE_DIR, CORE_KERNEL_CACHE and
CORE_GGUF_CACHE, which also holds the config.json records, pointed at new directories): a new
machine's start. The runs after it reuse what the first one compiled: a restart. Per run it
prints:

- wall seconds from the spawn to `ready`, and from `ready` to the first token's answer;
- the server process's phases (`client_startup_phases_s`: engine processes spawned, plan,
  tokenizer, the wait for the engine), and before them what the phases do not cover (the
  interpreter, imports, argument parsing: spawn-to-ready minus their sum);
- the engine process's phases (`startup_phases_s`: weights, memory plan, KV pool, model runner
  with the graph capture, scheduler), before them what they do not cover (its interpreter and
  imports: its life from the spawn to ready less their sum), and the engine's note on the graph
  capture.

A diagnostic of where start-up time goes, not a benchmark against a peer: the issue's target
is a bound (Llama-3.1-8B dummy on the H200 at most 15 s to the first token).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from serve_methods import _call  # noqa: E402  (one JSON request; a non-200 raises)
from serving_online import ServerProcess  # noqa: E402


def one_run(flags: list[str], caches: Path, log: Path, timeout: float) -> dict[str, Any]:
    """One fresh `core serve` with the kernel caches under `caches`: its figures."""
    res: dict[str, Any] = {}
    env = {"TRITON_CACHE_DIR": str(caches / "triton"), "CORE_KERNEL_CACHE": str(caches / "kernels"),
           "CORE_GGUF_CACHE": str(caches / "models")}
    try:  # the server copies this process's environment when it starts
        with mock.patch.dict(os.environ, env), ServerProcess(flags, log, timeout) as srv:
            res["spawn_to_ready_s"] = round(srv.startup_s, 3)
            t = time.perf_counter()
            out = _call(srv, "POST", "/generate",
                        {"text": "Hello", "sampling_params": {"max_new_tokens": 1,
                                                              "temperature": 0.0}})
            res["ready_to_first_token_s"] = round(time.perf_counter() - t, 3)
            res["first_token_text"] = out["text"]
            info = _call(srv, "GET", "/get_server_info")
    except Exception as exc:  # noqa: BLE001 - reported per run
        res["error"] = f"{type(exc).__name__}: {exc}"
        return res
    model = info.get("model", info)
    client = model.get("client_startup_phases_s") or {}
    res["client_phases_s"] = client
    res["engine_phases_s"] = model.get("startup_phases_s") or {}
    res["before_the_phases_s"] = round(res["spawn_to_ready_s"] - sum(client.values()), 3)
    # A prestarted engine process reports its imports and its wait for the plan as phases
    # (core.engine.worker.worker_prestarted); one that does not lived from the end of the
    # server's first phase (spawned) to ready, and what its phases miss is the rest
    if not any(k.startswith("waited for the plan") for k in res["engine_phases_s"]):
        res["engine_before_its_phases_s"] = round(
            sum(list(client.values())[1:]) - sum(res["engine_phases_s"].values()), 3)
    res["total_to_first_token_s"] = round(res["spawn_to_ready_s"]
                                          + res["ready_to_first_token_s"], 3)
    # Triton writes one directory per compiled kernel variant: how many a fresh machine built
    triton = caches / "triton"
    res["triton_cache_entries"] = sum(1 for _ in triton.iterdir()) if triton.is_dir() else 0
    res["triton_kernels"] = triton_kernels(triton)
    res["graph_notes"] = [n for n in model.get("engine_notes", ())
                          if "graph" in n.lower() and not n.startswith("start-up of")]
    res["plan"] = {k: info.get("plan", {}).get(k) for k in
                   ("quant_method", "decode_attention", "moe_runner", "layer_ops", "cuda_graph")}
    return res


def triton_kernels(cache: Path) -> list[dict[str, Any]]:
    """Each compiled variant in a Triton cache: its kernel name, launch options and the TTIR
    signature line, whose attributes (divisibility, constants folded in) say which
    specialization of the same source it is."""
    out: list[dict[str, Any]] = []
    for d in sorted(cache.iterdir()) if cache.is_dir() else ():
        for meta in d.glob("*.json"):
            if meta.name.startswith("__grp__"):
                continue
            try:
                m = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            sig = ""
            for ttir in d.glob("*.ttir"):
                sig = next((ln.strip() for ln in ttir.read_text().splitlines()
                            if "tt.func public" in ln), "")
            out.append({"name": m.get("name"), "num_warps": m.get("num_warps"),
                        "num_stages": m.get("num_stages"), "ttir_signature": sig[:600]})
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """One column per run, one row per phase (rows in the order the runs report them)."""
    heads = [("cold caches" if i == 0 else f"restart {i}") for i in range(len(runs))]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, get) -> None:
        rows.append((label, [(f"{v:.2f}" if isinstance(v, (int, float)) else "-")
                             for v in (get(r) for r in runs)]))

    row("spawn to ready (s)", lambda r: r.get("spawn_to_ready_s"))
    row("  before the server's phases: interpreter, imports, arguments",
        lambda r: r.get("before_the_phases_s"))
    client = [k for r in runs for k in r.get("client_phases_s", {})]
    for k in dict.fromkeys(client):
        row(f"  server: {k}", lambda r, k=k: r.get("client_phases_s", {}).get(k))
    row("    engine process before its phases: interpreter, imports",
        lambda r: r.get("engine_before_its_phases_s"))
    engine = [k for r in runs for k in r.get("engine_phases_s", {})]
    for k in dict.fromkeys(engine):
        row(f"    engine: {k}", lambda r, k=k: r.get("engine_phases_s", {}).get(k))
    row("ready to the first token (s)", lambda r: r.get("ready_to_first_token_s"))
    row("**spawn to the first token (s)**", lambda r: r.get("total_to_first_token_s"))
    rows.append(("Triton kernel cache entries after the run",
                 [str(r.get("triton_cache_entries", "-")) for r in runs]))
    lines = ["| phase | " + " | ".join(heads) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(vals) + " |" for label, vals in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where torch sees one, else cpu")
    p.add_argument("--config", default=None,
                   help="an HF config.json served with dummy weights (default on cuda: "
                        "Llama-3.1-8B's; on cpu: none, the default GGUF model)")
    p.add_argument("--runs", type=int, default=2,
                   help="fresh servers: the first with empty kernel caches, then restarts")
    p.add_argument("--extra", default="", help="more `core serve` flags, one string")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be >= 1")
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cold_start_"))
    flags = ["--device", a.device, *a.extra.split()]
    config = a.config
    if config is None and a.device == "cuda":
        from bench_serving import LLAMA_31_8B, make_model_dir
        model = make_model_dir(dict(LLAMA_31_8B), work / "model")
        flags += ["--model-path", model, "--load-format", "dummy", "--dtype", "bfloat16"]
        what = "Llama-3.1-8B's config, dummy bf16 weights"
    elif config is not None:
        from bench_serving import make_model_dir
        model = make_model_dir(json.loads(Path(config).read_text()), work / "model")
        flags += ["--model-path", model, "--load-format", "dummy"]
        what = f"{config}, dummy weights"
    else:
        what = "the default model"
    runs = [one_run(flags, work / "caches", work / f"server{i}.log", a.timeout)
            for i in range(a.runs)]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": a.device,
              "model": what, "flags": flags, "caches": str(work / "caches"), "runs": runs}
    print(f"{report['date']}: `core serve` on {a.device}, {what}; {a.runs} fresh server(s), "
          "the first with empty kernel caches\n")
    print(table(runs))
    for i, r in enumerate(runs):
        if "error" in r:
            print(f"\nrun {i}: {r['error']}")
        for note in r.get("graph_notes", ()):
            print(f"\nrun {i} engine note: {note}")
    if runs and runs[0].get("triton_kernels"):
        counts = collections.Counter(k["name"] for k in runs[0]["triton_kernels"])
        print("\nrun 0 Triton kernels compiled (variants of one source differ in their "
              "specialization; the JSON has each TTIR signature): "
              + ", ".join(f"{n} x{c}" for n, c in counts.most_common()))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {a.out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
