"""End-to-end serving benchmark: the engine against HF transformers on the same shapes, one run.

    python bench/bench_serving.py --out serving.json                  # GPU: Llama-3.1-8B shapes
    python bench/bench_serving.py --scenario cpu                      # tiny model, < 1 minute

Scenarios (random-token prompts, fixed input/output lengths, ignore_eos, greedy):
- batch 1: TTFT and decode tokens/s of one request, with CUDA graphs and with
  --disable-cuda-graph (GPU), against the weights-only roofline = copy bandwidth measured in this
  run / bytes of weights (every decode step reads every weight once);
- offline throughput: N requests submitted at once through core.Engine; request throughput,
  output tokens/s, TTFT / TPOT median and p99;
- the peer: HF transformers on a model of the same config with its own random weights (the engine
  uses --load-format dummy; values differ, shapes and dtype are the same): `generate` at batch 1,
  and `generate_batch` (continuous batching) on the first --hf-num-prompts prompts, falling back
  to padded `generate` when generate_batch is missing or fails (the report says which ran).
The GPU scenario prints "skipped" and exits 0 on a machine without CUDA. Results are printed as
JSON (and written to --out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"

LLAMA_31_8B = {  # public config shapes of meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu",
}
TINY = {**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
        "max_position_embeddings": 4096, "rope_scaling": None, "bos_token_id": 1,
        "eos_token_id": 2}


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes of a Llama-shaped model's weights (what one decode step reads at batch 1)."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], \
        cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    per_layer = qkv + cfg["num_attention_heads"] * d * h + 3 * h * i + 2 * h
    heads = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return (n * per_layer + heads + h) * dtype_bytes


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write), measured now."""
    n = 2**29 if device == "cuda" else 2**25  # 1 GiB / 64 MiB of bf16-sized elements
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 10
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    bw = 2 * n * 2 * reps / (time.perf_counter() - t)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine's worker sizes its KV cache from free memory
    return bw


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def make_model_dir(cfg: dict[str, Any]) -> str:
    sys.path.insert(0, str(TESTS_DIR))
    from model_fixtures import write_tokenizer  # a byte-level tokenizer: ids in, ids out

    d = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    (d / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(d)
    return str(d)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)
    return [[rng.randrange(lo, vocab - 1) for _ in range(length)] for _ in range(n)]


def run_stream(engine: Any, batch: list[list[int]], out_len: int) -> dict[str, Any]:
    """Submit all at once, stream; per-request TTFT and TPOT, totals."""
    sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    t0 = time.perf_counter()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    for chunk in engine.generate(input_ids=batch, sampling_params=sp, stream=True):
        now = time.perf_counter()
        i = chunk["index"]
        if chunk["token_ids"]:
            first.setdefault(i, now)
            last[i] = now
            count[i] = count.get(i, 0) + len(chunk["token_ids"])
    wall = time.perf_counter() - t0
    ttft = [first[i] - t0 for i in first]
    tpot = [(last[i] - first[i]) / (count[i] - 1) for i in first if count[i] > 1]
    out_tokens = sum(count.values())
    return {"requests": len(batch), "output_tokens": out_tokens, "wall_s": wall,
            "request_throughput": len(batch) / wall, "output_tok_s": out_tokens / wall,
            "ttft_median_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "tpot_median_s": pct(tpot, 0.5), "tpot_p99_s": pct(tpot, 0.99),
            "decode_tok_s_per_request": 1 / pct(tpot, 0.5) if tpot else None}


def bench_engine(model_dir: str, a: argparse.Namespace, graphs: bool, offline: bool
                 ) -> dict[str, Any]:
    from core import Engine

    kw: dict[str, Any] = {"load_format": "dummy", "device": a.device, "dtype": a.dtype}
    if not graphs:
        kw["disable_cuda_graph"] = True
    if a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    vocab = a.cfg["vocab_size"]
    t = time.perf_counter()
    with Engine(model_dir, **kw) as engine:
        res: dict[str, Any] = {"startup_s": time.perf_counter() - t,
                               "cuda_graph_batch_sizes": engine.info.get(
                                   "cuda_graph_batch_sizes", []),
                               "notes": engine.info.get("notes", []),
                               "decode_attention": engine.plan.decode_attention}
        # warm-up: compiles / autotunes the prompt lengths used below
        run_stream(engine, prompts(2, a.batch1_input_len, vocab, 1), 4)
        run_stream(engine, prompts(1, a.batch1_input_len, vocab, 2), a.batch1_output_len)
        b1 = run_stream(engine, prompts(1, a.batch1_input_len, vocab, 3), a.batch1_output_len)
        res["batch1"] = {"ttft_s": b1["ttft_median_s"],
                         "decode_tok_s": b1["decode_tok_s_per_request"],
                         "output_tokens": b1["output_tokens"]}
        if offline:
            run_stream(engine, prompts(4, a.input_len, vocab, 4), 4)
            res["offline"] = run_stream(engine, prompts(a.num_prompts, a.input_len, vocab, 5),
                                        a.output_len)
        stats = engine.stats()
        res["graph_replays"] = stats.get("graph_replays")
        res["decode_forwards"] = stats["forward_count"]["decode"]
    return res


def bench_hf(a: argparse.Namespace) -> dict[str, Any]:
    import transformers

    dtype = getattr(torch, a.dtype)
    cfg = transformers.LlamaConfig(**{k: v for k, v in a.cfg.items()
                                      if k not in ("architectures", "torch_dtype")})
    t = time.perf_counter()
    with torch.device(a.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.eval()
    res: dict[str, Any] = {"transformers": transformers.__version__,
                           "load_s": time.perf_counter() - t}
    vocab = a.cfg["vocab_size"]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def gen(ids: torch.Tensor, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    one = torch.tensor(prompts(1, a.batch1_input_len, vocab, 3), device=a.device)
    gen(one, 4)  # warm-up
    ttft = gen(one, 1)
    n = a.hf_batch1_output_len
    total = gen(one, n)
    res["batch1"] = {"ttft_s": ttft, "decode_tok_s": (n - 1) / (total - ttft),
                     "output_tokens": n}
    batch = prompts(a.hf_num_prompts, a.input_len, vocab, 5)
    res["offline"] = hf_offline(model, batch, a, gen)
    return res


def hf_offline(model: Any, batch: list[list[int]], a: argparse.Namespace, gen: Any
               ) -> dict[str, Any]:
    import transformers

    try:
        if a.hf_offline != "generate_batch":
            raise RuntimeError("not asked for (--hf-offline generate)")
        gc = transformers.GenerationConfig(max_new_tokens=a.output_len, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=batch, generation_config=gc)
        wall = time.perf_counter() - t0
        tokens = sum(len(getattr(o, "generated_tokens", ()) or ()) for o in outs.values())
        if tokens == 0:
            raise RuntimeError("generate_batch returned no tokens")
        return {"method": "generate_batch", "requests": len(batch), "output_tokens": tokens,
                "wall_s": wall, "output_tok_s": tokens / wall}
    except Exception as exc:  # noqa: BLE001 - the peer's API varies by version; say what ran
        ids = torch.tensor(batch, device=a.device)  # equal lengths: no padding needed
        wall = gen(ids, a.output_len)
        tokens = len(batch) * a.output_len
        return {"method": f"padded generate (generate_batch: {type(exc).__name__}: {exc})"[:300],
                "requests": len(batch), "output_tokens": tokens, "wall_s": wall,
                "output_tok_s": tokens / wall}


def ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=None)
    p.add_argument("--hf-num-prompts", type=int, default=None)
    p.add_argument("--hf-batch1-output-len", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-offline", choices=("generate_batch", "generate"), default=None,
                   help="the peer's offline method (default: generate_batch on GPU)")
    p.add_argument("--skip-eager", action="store_true", help="no --disable-cuda-graph run")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    gpu = a.scenario == "gpu"
    if gpu and not torch.cuda.is_available():
        print("skipped: the gpu scenario needs CUDA (try --scenario cpu)")
        return 0
    a.device = "cuda" if gpu else "cpu"
    a.cfg = LLAMA_31_8B if gpu else TINY
    defaults = dict(dtype="bfloat16" if gpu else "float32", num_prompts=128 if gpu else 8,
                    input_len=1024 if gpu else 64, output_len=256 if gpu else 16,
                    batch1_output_len=256 if gpu else 32, hf_num_prompts=16 if gpu else 4,
                    hf_batch1_output_len=64 if gpu else 32,
                    hf_offline="generate_batch" if gpu else "generate")
    if not gpu:
        a.skip_eager = True  # no graphs on a CPU: the eager run would be the same run
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if not gpu and a.max_total_tokens is None:
        a.max_total_tokens = 8192
    model_dir = make_model_dir(a.cfg)
    elem = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    wbytes = weight_bytes(a.cfg, elem)
    bw = copy_bandwidth(a.device)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
        "args": {k: v for k, v in vars(a).items() if k != "cfg"},
        "weight_bytes": wbytes, "copy_bw_GBps": bw / 1e9, "roofline_decode_tok_s": bw / wbytes}

    def save() -> None:  # after every stage, so a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2, default=str))

    save()
    report["engine_graphs"] = bench_engine(model_dir, a, graphs=True, offline=True)
    save()
    if not a.skip_hf:  # before the eager run: the peer matters more if time runs out
        report["hf"] = bench_hf(a)
        if gpu:
            torch.cuda.empty_cache()
        save()
    if not a.skip_eager:
        report["engine_eager"] = bench_engine(model_dir, a, graphs=False, offline=False)
        save()
    eg = report["engine_graphs"]
    roof = report["roofline_decode_tok_s"]
    summary = {
        "batch1_decode_tok_s_graphs": eg["batch1"]["decode_tok_s"],
        "batch1_vs_roofline": ratio(eg["batch1"]["decode_tok_s"], roof),
        "offline_output_tok_s": eg["offline"]["output_tok_s"],
    }
    if "engine_eager" in report:
        ee = report["engine_eager"]["batch1"]["decode_tok_s"]
        summary["batch1_decode_tok_s_eager"] = ee
        summary["batch1_graphs_vs_eager"] = ratio(eg["batch1"]["decode_tok_s"], ee)
    if "hf" in report:
        hf = report["hf"]
        summary["batch1_vs_hf"] = ratio(eg["batch1"]["decode_tok_s"], hf["batch1"]["decode_tok_s"])
        summary["offline_vs_hf"] = ratio(eg["offline"]["output_tok_s"],
                                         hf["offline"]["output_tok_s"])
        summary["hf_offline_method"] = hf["offline"]["method"]
    report["summary"] = summary
    save()
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
