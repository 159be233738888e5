"""End-to-end serving benchmark: the engine against HF transformers on the same shapes, one run.

    python bench/bench_serving.py --out serving.json                  # GPU: Llama-3.1-8B shapes
    python bench/bench_serving.py --scenario cpu                      # tiny model, ~1 minute
    python bench/bench_serving.py --modes online,shared-prefix ...    # a subset of the modes
    python bench/bench_serving.py --modes offline,online --skip-hf --online-num-prompts 600 \
        --request-rate inf --max-concurrency 256 \
        --online-variants off='--decode-itl-target-ms 0' on='--decode-itl-target-ms 50'
                                                       # saturation: the prefill budget off vs on

Random-token prompts, fixed input/output lengths, ignore_eos, greedy. The model is a config with
--load-format dummy and a word-level tokenizer covering the whole vocabulary (every id decodes to
text, as with a real tokenizer, so every generated token is streamed). Modes (--modes):
- batch1: TTFT and decode tokens/s of one request, with CUDA graphs and with --disable-cuda-graph
  (GPU), against the weights-only roofline = copy bandwidth measured in this run / bytes of weights
  (every decode step reads every weight once);
- offline: --num-prompts requests submitted at once through core.Engine; request throughput,
  input / output tokens/s, TTFT / TPOT / end-to-end latency (mean, median, p99); on the GPU
  also its floor (bench/floors.py: prefill FLOPs at this run's bf16 matmul rate + decode bytes
  at its copy bandwidth) and floor / wall;
- online: `core serve` in a subprocess on the same model; --online-num-prompts requests at
  --request-rate (Poisson arrivals; inf = all at once) under --max-concurrency, streamed (SSE)
  through /v1/completions with token-id prompts; SGLang bench_serving's metrics (completed /
  failed, duration, request and token throughputs, TTFT / TPOT / ITL / E2E mean, median, p99);
  with --online-variants NAME=FLAGS ..., once per variant (its `core serve` flags appended to
  --server-extra-args, a fresh server each), so settings compare in one run (the prefill
  budget: off='--decode-itl-target-ms 0' on='--decode-itl-target-ms 50'), each beside offline
  (and --offline-variants NAME=JSON ...: the offline mode again with these core.Engine flags);
- shared-prefix: --shared-prefix-num-requests prompts = one shared prefix + distinct suffixes,
  through core.Engine with the radix cache on and with disable_radix_cache=True; each run first
  sends two warm-up requests with the prefix (other suffixes) one after the other, then submits the
  measured batch at once, so with the cache on every measured request can hit the prefix. The radix
  run reuses the batch1/offline engine (prefix cache flushed first) when there is one.
- the peer (with batch1 / offline): HF transformers on a model of the same config with its own
  random weights (values differ, shapes and dtype are the same): `generate` at batch 1, and
  `generate_batch` (continuous batching) on --hf-num-prompts prompts, falling back to padded
  `generate` when generate_batch is missing or fails (the report says which ran).
--config PATH serves another architecture's config (a MoE's batch-1 roofline counts its
active weights, bench/moe_decode.py's count). The GPU scenario prints "skipped" and exits 0 on a
machine without CUDA. Results are one JSON,
printed and written to --out (after every stage), then a summary table.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO)):  # bench this checkout, whatever else is installed
    if _p not in sys.path:
        sys.path.insert(0, _p)

from cli_lists import choice_list  # noqa: E402
from serving_online import bench_online, latency_stats  # noqa: E402
from serving_report import jsonable, ratio, summarize, summary_table  # noqa: E402
from stages import Stages, new_report  # noqa: E402

from conformance.model_configs import LLAMA_31_8B, llama_config  # noqa: E402

MODES = ("batch1", "offline", "online", "shared-prefix")
LINEAR_BYTES = {"fp8": 1, "w8a8_int8": 1, "awq": 0.5, "gptq": 0.5}  # per weight, scales aside
QUANT_CONFIGS = {"fp8-block": {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                 "awq": {"quant_method": "awq", "bits": 4, "group_size": 128,
                         "zero_point": True, "version": "gemm"},
                 "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                          "desc_act": False, "sym": True, "checkpoint_format": "gptq"}}
QUANT_CONFIG_METHOD = {"fp8-block": "fp8", "awq": "awq", "gptq": "gptq"}

TINY = llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                    max_position_embeddings=4096, rope_scaling=None, bos_token_id=1,
                    eos_token_id=2)

# (gpu, cpu) defaults of the flags left unset
DEFAULTS = {
    "dtype": ("bfloat16", "float32"), "num_prompts": (1000, 8), "input_len": (1024, 64),
    "output_len": (256, 16), "batch1_output_len": (256, 32), "hf_num_prompts": (32, 4),
    "hf_batch1_output_len": (64, 32), "hf_offline": ("generate_batch", "generate"),
    "online_num_prompts": (200, 8), "request_rate": (8.0, 8.0), "max_concurrency": (64, 4),
    "shared_prefix_len": (2048, 256), "shared_prefix_num_requests": (64, 16),
    "shared_prefix_suffix_len": (32, 16), "shared_prefix_output_len": (32, 8),
    "max_total_tokens": (None, 8192),
}


def weight_bytes(cfg: dict[str, Any], dtype_bytes: float, linear_bytes: float | None = None
                 ) -> int:
    """Weight bytes one decode step reads at batch 1 in a Llama-shaped model: the decoder's
    linear layers at `linear_bytes` per weight when quantized (1 for fp8 / int8), the norms, the
    LM head (the whole vocab x hidden table, tied or not) and one row of the embedding table
    (a lookup reads the row of its token, not the table), all but the linears at dtype_bytes."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], \
        cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    linear = qkv + cfg["num_attention_heads"] * d * h + 3 * h * i
    lb = dtype_bytes if linear_bytes is None else linear_bytes
    head_and_row = v * h + h
    return int(n * linear * lb + (n * 2 * h + head_and_row + h) * dtype_bytes)


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


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one plain token per id ("t0" ... ), no special tokens.

    Every id decodes to text, so a streamed token is never held back or dropped as it would be
    with a tokenizer smaller than the model's vocabulary; EOS comes from config.json.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


def make_model_dir(cfg: dict[str, Any], d: Path | None = None) -> str:
    """config.json + tokenizer in d (default: a new temporary directory, left for the caller)."""
    d = Path(tempfile.mkdtemp(prefix="bench_serving_")) if d is None else d
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(d, cfg["vocab_size"])
    return str(d)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = range(min(1000, vocab // 4), vocab - 1)
    return [rng.choices(ids, k=length) for _ in range(n)]


def shared_prefix_prompts(a: argparse.Namespace, warmup: int = 2
                          ) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up, measured) prompts: one prefix + suffixes whose first tokens all differ."""
    vocab = a.cfg["vocab_size"]
    n = a.shared_prefix_num_requests + warmup
    rng = random.Random(11)
    ids = range(min(1000, vocab // 4), vocab - 1)
    prefix = rng.choices(ids, k=a.shared_prefix_len)
    firsts = rng.sample(ids, n) if n <= len(ids) else rng.choices(ids, k=n)
    out = [prefix + [f] + rng.choices(ids, k=a.shared_prefix_suffix_len - 1) for f in firsts]
    return out[:warmup], out[warmup:]


def run_stream(engine: Any, batch: list[list[int]], out_len: int, per_request: bool = False
               ) -> dict[str, Any]:
    """Submit all at once and stream; throughputs, latency percentiles, cached prompt tokens.

    Keeps O(1) state per request (first / last token time, counts), whatever the batch size.
    """
    sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    n = len(batch)
    first: list[float | None] = [None] * n
    last = [0.0] * n
    count = [0] * n
    cached = [0] * n
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=batch, sampling_params=sp, stream=True):
        now = time.perf_counter()
        i = chunk["index"]
        if chunk["token_ids"]:
            if first[i] is None:
                first[i] = now
            last[i] = now
            count[i] += len(chunk["token_ids"])
        if chunk["finish_reason"] is not None:
            cached[i] = int((chunk.get("meta_info") or {}).get("cached_tokens") or 0)
    wall = time.perf_counter() - t0
    done = [i for i in range(n) if first[i] is not None]
    tin = sum(len(p) for p in batch)
    tout = sum(count)
    res = {"requests": n, "input_tokens": tin, "output_tokens": tout, "wall_s": wall,
           "request_throughput": n / wall, "input_tok_s": tin / wall, "output_tok_s": tout / wall,
           "total_tok_s": (tin + tout) / wall, "output_tokens_min": min(count, default=0),
           "output_tokens_max": max(count, default=0), "cached_tokens_total": sum(cached),
           **latency_stats("ttft", [first[i] - t0 for i in done]),
           **latency_stats("tpot", [(last[i] - first[i]) / (count[i] - 1)
                                    for i in done if count[i] > 1]),
           **latency_stats("e2e", [last[i] - t0 for i in done])}
    med = res["tpot_median_ms"]
    res["decode_tok_s_per_request"] = 1e3 / med if med else None
    if per_request:
        res["per_request"] = [{"output_tokens": count[i], "cached_tokens": cached[i],
                               "ttft_ms": None if first[i] is None else (first[i] - t0) * 1e3,
                               "e2e_ms": (last[i] - t0) * 1e3} for i in range(n)]
    return res


def engine_kwargs(a: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"load_format": "dummy", "device": a.device, "dtype": a.dtype,
                          **(json.loads(a.engine_extra) if a.engine_extra else {}), **extra}
    if a.quantization:
        kw["quantization"] = a.quantization
    if a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    return kw


def measure_batch1(engine: Any, a: argparse.Namespace) -> dict[str, Any]:
    vocab = a.cfg["vocab_size"]
    # warm-up: compiles / autotunes the prompt length used below
    run_stream(engine, prompts(2, a.batch1_input_len, vocab, 1), 4)
    run_stream(engine, prompts(1, a.batch1_input_len, vocab, 2), a.batch1_output_len)
    b1 = run_stream(engine, prompts(1, a.batch1_input_len, vocab, 3), a.batch1_output_len)
    return {"ttft_ms": b1["ttft_median_ms"], "decode_tok_s": b1["decode_tok_s_per_request"],
            "output_tokens": b1["output_tokens"]}


def measure_offline(engine: Any, a: argparse.Namespace) -> dict[str, Any]:
    vocab = a.cfg["vocab_size"]
    run_stream(engine, prompts(4, a.input_len, vocab, 4), 4)  # warm-up at this prompt length
    batch = prompts(a.num_prompts, a.input_len, vocab, 5)
    return {"input_len": a.input_len, "output_len": a.output_len,
            **run_stream(engine, batch, a.output_len, a.per_request)}


def measure_shared_prefix(engine: Any, a: argparse.Namespace) -> dict[str, Any]:
    warm, timed = shared_prefix_prompts(a)
    out = a.shared_prefix_output_len
    warm_res = [run_stream(engine, [w], out) for w in warm]  # one after the other
    s0 = engine.stats()
    res = run_stream(engine, timed, out, a.per_request)
    s1 = engine.stats()
    res["warmup_cached_tokens"] = [w["cached_tokens_total"] for w in warm_res]
    res["warmup_ttft_ms"] = [w["ttft_median_ms"] for w in warm_res]
    # the scheduler's own counters over the measured batch
    res["engine_prefill_tokens"] = s1["prefill_tokens"] - s0["prefill_tokens"]
    res["engine_cached_tokens"] = s1["cached_tokens"] - s0["cached_tokens"]
    return res


def bench_engine(model_dir: str, a: argparse.Namespace, *, graphs: bool = True,
                 radix: bool = True, batch1: bool = False, offline: bool = False,
                 shared_prefix: bool = False, engine_flags: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """engine_flags: more core.Engine flags (bench_parallel's --tp-size / --dp-size)."""
    from core import Engine

    extra: dict[str, Any] = dict(engine_flags or {})
    if not graphs:
        extra["disable_cuda_graph"] = True
    if not radix:
        extra["disable_radix_cache"] = True
    t = time.perf_counter()
    with Engine(model_dir, **engine_kwargs(a, **extra)) as engine:
        res: dict[str, Any] = {"startup_s": time.perf_counter() - t,
                               "cuda_graph_batch_sizes": list(
                                   engine.info.cuda_graph_batch_sizes),
                               "notes": list(engine.info.notes),
                               "max_running_requests": engine.info.max_running_requests,
                               "pool_tokens": engine.info.pool_tokens,
                               "decode_attention": engine.plan.decode_attention}
        if batch1:
            res["batch1"] = measure_batch1(engine, a)
        if offline:
            res["offline"] = measure_offline(engine, a)
        if shared_prefix:
            if batch1 or offline:
                engine.flush_cache()  # start the radix run from an empty prefix cache
            res["shared_prefix"] = measure_shared_prefix(engine, a)
        stats = engine.stats()
        res["graph_replays"] = stats.get("graph_replays")
        res["decode_forwards"] = stats["forward_count"]["decode"]
        res["retractions"] = stats.get("retractions")
        res["prefill_capped_steps"] = stats.get("prefill_capped_steps")
    return res


def floor_report(a: argparse.Namespace, report: dict[str, Any], off: dict[str, Any],
                 elem: int) -> dict[str, Any]:
    """The offline run against its floor (bench/floors.py) from this run's ceilings."""
    from floors import offline_floor

    running = report["engine_graphs"].get("max_running_requests") or a.num_prompts
    f = offline_floor(a.cfg, a.num_prompts, a.input_len, a.output_len, running,
                      report["matmul_TFLOPs"] * 1e12, report["copy_bw_GBps"] * 1e9, elem)
    return {**f, "max_running_requests": running, "wall_s": off["wall_s"],
            "fraction": f["floor_s"] / off["wall_s"]}


def bench_hf(a: argparse.Namespace, batch1: bool, offline: bool) -> dict[str, Any]:
    import transformers

    dtype = getattr(torch, a.dtype)
    kw = {k: v for k, v in a.cfg.items() if k not in ("architectures", "torch_dtype")}
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw) \
        if "model_type" in kw else transformers.LlamaConfig(**kw)
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
    if batch1:
        ttft = gen(one, 1)
        n = a.hf_batch1_output_len
        total = gen(one, n)
        res["batch1"] = {"ttft_ms": ttft * 1e3, "decode_tok_s": (n - 1) / (total - ttft),
                         "output_tokens": n}
    if offline:
        batch = prompts(a.hf_num_prompts, a.input_len, vocab, 5)
        res["offline"] = hf_offline(model, batch, a, gen)
    return res


def hf_offline(model: Any, batch: list[list[int]], a: argparse.Namespace, gen: Any
               ) -> dict[str, Any]:
    import transformers

    try:
        if a.hf_offline != "generate_batch":
            raise RuntimeError("not asked for (--hf-offline generate)")
        gc_ = transformers.GenerationConfig(max_new_tokens=a.output_len, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=batch, generation_config=gc_)
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


def shared_prefix_report(a: argparse.Namespace, on: dict[str, Any], off: dict[str, Any]
                         ) -> dict[str, Any]:
    """The radix-on run (from the main engine) beside the radix-off run (its own engine)."""
    off_run = off.get("shared_prefix", off)  # an {"error": ...} when that engine failed
    on_tp, off_tp = on.get("request_throughput"), off_run.get("request_throughput")
    return {
        "workload": {"num_requests": a.shared_prefix_num_requests,
                     "prefix_len": a.shared_prefix_len, "suffix_len": a.shared_prefix_suffix_len,
                     "output_len": a.shared_prefix_output_len,
                     "warmup": "2 requests with the prefix and other suffixes, one after the "
                               "other, before the measured batch (submitted at once), in both "
                               "runs",
                     "radix_on_engine": "the batch1/offline engine, prefix cache flushed"
                     if {"batch1", "offline"} & set(a.modes) else "its own engine"},
        "radix_on": on, "radix_off": off_run, "radix_off_startup_s": off.get("startup_s"),
        "ratio": ratio(on_tp, off_tp)}


def run_online(model_dir: str, a: argparse.Namespace, log: Path) -> dict[str, Any]:
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--device", a.device,
             "--dtype", a.dtype]
    if a.max_total_tokens:
        flags += ["--max-total-tokens", str(a.max_total_tokens)]
    if a.quantization:
        flags += ["--quantization", a.quantization]
    flags += shlex.split(a.server_extra_args or "")
    vocab = a.cfg["vocab_size"]
    batch = prompts(a.online_num_prompts, a.online_input_len, vocab, 21)
    warm = prompts(a.online_warmup, a.online_input_len, vocab, 22)
    res = bench_online(flags, batch, a.online_output_len, a.request_rate, a.max_concurrency,
                       warm, log, a.server_startup_timeout, a.per_request)
    res["server_flags"] = ["<model dir>" if f == model_dir else f for f in flags]
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--config", default=None,
                   help="an HF config.json to serve instead of Llama-3.1-8B (gpu) / the tiny "
                   "Llama (cpu), e.g. tests/fixtures/configs/qwen3-30b-a3b.json; MoE configs "
                   "take the active-weights roofline, and offline reports its floor")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quant-config", choices=sorted(QUANT_CONFIGS), default=None,
                   help="give the dummy model a quantization_config (fp8-block: the Qwen3 / "
                        "DeepSeek FP8 format; awq, gptq: INT4 group 128), so it is served as "
                        "a quantized checkpoint")
    p.add_argument("--quantization", default=None,
                   help="quant method for the engine (a dense dummy model quantized at load: "
                        "fp8, w8a8_int8); the roofline counts its linear weights at 1 byte")
    p.add_argument("--num-prompts", type=int, default=None, help="offline requests")
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=None)
    p.add_argument("--hf-num-prompts", type=int, default=None)
    p.add_argument("--hf-batch1-output-len", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--engine-extra", default=None,
                   help='more core.Engine flags for our engine runs, as JSON '
                        '(e.g. \'{"cuda_graph_max_bs": 256}\')')
    p.add_argument("--hf-offline", choices=("generate_batch", "generate"), default=None,
                   help="the peer's offline method (default: generate_batch on GPU)")
    p.add_argument("--skip-eager", action="store_true", help="no --disable-cuda-graph run")
    g = p.add_argument_group("online (a core serve subprocess)")
    g.add_argument("--online-num-prompts", type=int, default=None)
    g.add_argument("--online-input-len", type=int, default=None, help="default: --input-len")
    g.add_argument("--online-output-len", type=int, default=None, help="default: --output-len")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests/s, Poisson arrivals; inf sends all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="0: no cap")
    g.add_argument("--online-warmup", type=int, default=2, help="warm-up requests (not timed)")
    g.add_argument("--server-extra-args", default="", help="more `core serve` flags, quoted")
    p.add_argument("--offline-variants", nargs="+", default=None, metavar="NAME=JSON",
                   help="run the offline mode again per variant with these core.Engine flags "
                   "over --engine-extra (e.g. budget-on='{\"decode_itl_target_ms\": 50}': "
                   "the offline Engine leaves the prefill budget off); results under "
                   "offline_variants")
    g.add_argument("--online-variants", nargs="+", default=None, metavar="NAME=FLAGS",
                   help="run the online mode once per variant, its flags appended to "
                   "--server-extra-args (e.g. off='--decode-itl-target-ms 0' "
                   "on='--decode-itl-target-ms 50'); results under online_variants")
    g.add_argument("--server-startup-timeout", type=float, default=900.0)
    g = p.add_argument_group("shared-prefix (radix cache on vs off)")
    g.add_argument("--shared-prefix-len", type=int, default=None)
    g.add_argument("--shared-prefix-num-requests", type=int, default=None)
    g.add_argument("--shared-prefix-suffix-len", type=int, default=None)
    g.add_argument("--shared-prefix-output-len", type=int, default=None)
    p.add_argument("--per-request", action="store_true",
                   help="add per-request records to the online, offline and shared-prefix results")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    a.modes = choice_list(p, "--modes", a.modes, MODES)
    gpu = a.scenario == "gpu"
    for k, (g_val, c_val) in DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, g_val if gpu else c_val)
    if a.online_input_len is None:
        a.online_input_len = a.input_len
    if a.online_output_len is None:
        a.online_output_len = a.output_len
    if a.max_concurrency == 0:
        a.max_concurrency = None
    variants = {}
    for v in a.online_variants or ():
        name, sep, flags = v.partition("=")
        if not sep or not name or name in variants:
            p.error(f"--online-variants: {v!r} is not NAME=FLAGS with a new NAME")
        variants[name] = flags
    a.online_variants = variants
    offline_variants = {}
    for v in a.offline_variants or ():
        name, sep, flags = v.partition("=")
        try:
            flags = json.loads(flags) if sep else None
        except ValueError:
            flags = None
        if not name or not isinstance(flags, dict) or name in offline_variants:
            p.error(f"--offline-variants: {v!r} is not NAME=JSON (an object) with a new NAME")
        offline_variants[name] = flags
    a.offline_variants = offline_variants
    if a.shared_prefix_suffix_len < 1:
        p.error("--shared-prefix-suffix-len must be >= 1")
    if not gpu:
        a.skip_eager = True  # no graphs on a CPU: the eager run would be the same run
    a.device = "cuda" if gpu else "cpu"
    a.cfg = json.loads(Path(a.config).read_text()) if a.config else \
        dict(LLAMA_31_8B if gpu else TINY)
    if a.quant_config:  # the checkpoint itself quantized (dummy weights in its format)
        a.cfg["quantization_config"] = QUANT_CONFIGS[a.quant_config]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    gpu = a.scenario == "gpu"
    if gpu and not torch.cuda.is_available():
        print("skipped: the gpu scenario needs CUDA (try --scenario cpu)")
        return 0
    # `timeout` and schedulers stop us with SIGTERM: unwind, so the server and engines stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = set(a.modes)
    report = new_report(a, gpu)
    # a failing stage is reported (and fails the exit code), the rest still run
    stage = Stages(report, a.out, gpu)
    save, failed, stages = stage.save, stage.failed, report["stage_wall_s"]

    elem = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    moe = bool(a.cfg.get("num_experts") or a.cfg.get("num_local_experts")
               or a.cfg.get("n_routed_experts"))
    if modes & {"batch1", "offline"}:
        report["copy_bw_GBps"] = copy_bandwidth(a.device) / 1e9
    if "batch1" in modes:
        method = a.quantization or QUANT_CONFIG_METHOD.get(a.quant_config or "")
        if moe:  # the weights one token reads: its top-k experts, not all
            from moe_decode import active_bytes_per_token

            wbytes = active_bytes_per_token(a.cfg, elem)
        else:
            wbytes = weight_bytes(a.cfg, elem, LINEAR_BYTES.get(method))
        report.update({"weight_bytes": wbytes,
                       "roofline_decode_tok_s": report["copy_bw_GBps"] * 1e9 / wbytes})
    if "offline" in modes and gpu:
        from ceilings import matmul_rate

        report["matmul_TFLOPs"] = matmul_rate(torch.device("cuda"),
                                              getattr(torch, a.dtype)) / 1e12
    save()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        model_dir = make_model_dir(a.cfg, Path(tmp) / "model")
        # Order: what matters most first, so a run cut short keeps it.
        if modes & {"batch1", "offline", "shared-prefix"}:
            report["engine_graphs"] = stage(
                "engine", bench_engine, model_dir, a, batch1="batch1" in modes,
                offline="offline" in modes, shared_prefix="shared-prefix" in modes)
            off = report["engine_graphs"].get("offline")
            if off and "matmul_TFLOPs" in report:
                report["offline_floor"] = floor_report(a, report, off, elem)
            save()
        for name, flags in a.offline_variants.items() if "offline" in modes else ():
            report.setdefault("offline_variants", {})[name] = stage(
                f"offline[{name}]", bench_engine, model_dir, a, offline=True,
                engine_flags=flags)
            save()
        if "shared-prefix" in modes:
            off = stage("engine_no_radix", bench_engine, model_dir, a, radix=False,
                        shared_prefix=True)
            report["shared_prefix"] = shared_prefix_report(
                a, report["engine_graphs"].pop("shared_prefix", report["engine_graphs"]), off)
            save()
        if "online" in modes and not a.online_variants:
            log = Path(a.out).with_suffix(".server.log") if a.out else Path(tmp) / "server.log"
            report["online"] = stage("online", run_online, model_dir, a, log)
            save()
        for name, flags in a.online_variants.items() if "online" in modes else ():
            log = (Path(a.out).with_suffix(f".{name}.server.log") if a.out
                   else Path(tmp) / f"server.{name}.log")
            va = argparse.Namespace(**{**vars(a), "server_extra_args":
                                       f"{a.server_extra_args or ''} {flags}".strip()})
            report.setdefault("online_variants", {})[name] = stage(
                f"online[{name}]", run_online, model_dir, va, log)
            save()
        if modes & {"batch1", "offline"} and not a.skip_hf:
            # before the eager run: the peer matters more if time runs out
            report["hf"] = stage("hf", bench_hf, a, "batch1" in modes, "offline" in modes)
            save()
        if "batch1" in modes and not a.skip_eager:
            report["engine_eager"] = stage("engine_eager", bench_engine, model_dir, a,
                                           graphs=False, batch1=True)
            save()
    stages["total"] = round(time.perf_counter() - t_start, 1)
    report["failed_stages"] = failed
    report["summary"] = summarize(report)
    save()
    print(json.dumps(jsonable(report), indent=2, default=str))
    print()
    print(summary_table(report))
    if failed:
        print(f"\nfailed stages: {', '.join(failed)} (see their 'error' in the JSON)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
