"""Where a batch-1 decode step's time goes on the GPU (a diagnostic, not a benchmark).

    python bench/profile_decode.py --out profile.json     # Llama-3.1-8B shapes, bf16, dummy

Builds the engine core in this process (no worker, no pipe) and reports, for batch sizes given:
- the CUDA-graph replay alone (GPU time by CUDA events, no host work between replays);
- one scheduler step end to end (host wall time: inputs, replay, sampling, the host sync,
  bookkeeping), so step - replay = host overhead the GPU waits for;
- the weights-only roofline from the copy bandwidth measured now;
- the top kernels of a few decode steps by GPU time (torch.profiler);
- with --profile-prefill, the top kernels of the prefill of the largest batch too (every step
  of it: the first steps also compile Triton kernels, which costs host time, not GPU time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import LLAMA_31_8B, QUANT_CONFIGS, copy_bandwidth, make_model_dir, weight_bytes  # noqa: E402

SHAPES = False  # --shapes: record the ops' input shapes (the by-shape table)


def _profiler() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA],
                                  record_shapes=SHAPES)


def _kernels(prof: torch.profiler.profile, rows: int) -> tuple[int, float, str]:
    """(GPU events the profiler saw, their total us, the top `rows` by GPU time as a table;
    with --shapes, a second table of the ops by input shape: which call launched a kernel)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    if SHAPES:
        table += "\n" + prof.key_averages(group_by_input_shape=True).table(
            sort_by="cuda_time_total", row_limit=rows)
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels), table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", type=int, default=40, help="rows of the kernel table")
    p.add_argument("--graph-max-bs", type=int, default=32,
                   help="largest captured decode batch (0: no graphs, every step eager)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shapes", action="store_true",
                   help="record input shapes: a second table by (op, shapes); decode steps "
                        "replayed from graphs have no ops, so use --graph-max-bs 0 with it")
    p.add_argument("--profile-prefill", action="store_true",
                   help="profile the prefill of the largest batch size (kernels by GPU time)")
    p.add_argument("--config", default=None, help="an HF config.json to profile instead of "
                   "Llama-3.1-8B (MoE models: the roofline then uses the active weights, "
                   "bench/moe_decode.py's count)")
    p.add_argument("--quantization", default=None,
                   help="online quant method (`core serve --quantization`), e.g. fp8")
    p.add_argument("--quant-config", default=None, choices=sorted(QUANT_CONFIGS),
                   help="give the dummy checkpoint this quantization_config (awq, gptq, "
                   "fp8-block)")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="speculation on (ngram), and per batch size the cost of a verify "
                   "step with K drafts a request against a plain step (bench/verify_cost.py)")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="serve N random rank-16 PEFT adapters on every projection (LoRA on, "
                   "its default backend), the requests spread over them")
    a = p.parse_args(argv)
    global SHAPES
    SHAPES = a.shapes
    if not torch.cuda.is_available():
        print("skipped: needs CUDA")
        return 0
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    cfg = dict(LLAMA_31_8B if a.config is None else json.loads(Path(a.config).read_text()))
    if a.quant_config:
        cfg["quantization_config"] = QUANT_CONFIGS[a.quant_config]
    quantized = bool(a.quantization or a.quant_config)
    bw = copy_bandwidth("cuda")
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        from moe_decode import active_bytes_per_token

        # the active weights at the checkpoint's widths (an fp8 checkpoint's projections and
        # experts one byte a weight, the rest 16-bit: bench/moe_decode.py); DeepSeek configs
        # (n_routed_experts) too, which the Llama-shaped count below gets wrong
        wbytes = active_bytes_per_token(cfg, 2)
    else:
        # the decoder's linear weights at their stored width (int4: half a byte; the scales
        # are left out, so the roofline is a little optimistic for the quantized methods)
        lin = None
        if quantized:
            lin = 0.5 if a.quant_config in ("awq", "gptq") else 1.0
        wbytes = weight_bytes(cfg, 2, lin)
    model_dir = make_model_dir(cfg)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    bs_max = max(sizes)
    pool = max(65536, 2 * bs_max * (a.prompt_len + 3 * a.steps))
    lora: dict = {}
    if a.lora:
        import tempfile

        from bench_lora_serving import write_adapters

        adapters = write_adapters(cfg, Path(tempfile.mkdtemp(prefix="profile_lora_")), a.lora,
                                  16, 32.0, torch.bfloat16)
        lora = {"enable_lora": True, "max_loras_per_batch": a.lora,
                "lora_paths": [f"{k}={v}" for k, v in adapters.items()]}
    args = make_server_args(model_path=model_dir, load_format="dummy", dtype="bfloat16",
                            device="cuda", max_total_tokens=pool,
                            cuda_graph_max_bs=a.graph_max_bs or None,
                            disable_cuda_graph=a.graph_max_bs == 0,
                            max_running_requests=max(bs_max, 1),
                            **({"quantization": a.quantization} if a.quantization else {}),
                            **lora,
                            **({"speculative_algorithm": "ngram", "speculative_governor": "off",
                                "speculative_num_draft_tokens": a.verify} if a.verify else {}))
    args, plan, spec, registry = make_plan(args)
    core = build_engine_core(args, plan, spec, registry)
    sched = core.scheduler
    runner = sched.runner
    gr = runner.graph_runner
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "quant_method": getattr(plan, "quant_method", None),
                    "copy_bw_GBps": bw / 1e9, "weight_bytes": wbytes,
                    "roofline_ms_per_step_b1": wbytes / bw * 1e3,
                    "graph_sizes": sorted(gr.graphs) if gr else [], "batches": {}}
    n = 0
    gen = torch.Generator().manual_seed(0)
    for bs in sizes:
        for _ in range(bs):
            # distinct random prompts: identical ones would share their KV pages (radix cache,
            # all in L2) and route every token to the same experts
            ids = torch.randint(1000, cfg["vocab_size"], (a.prompt_len,), generator=gen)
            sched.add_request(f"r{n}", ids.tolist(),
                              {"temperature": 0, "max_new_tokens": a.steps * 3,
                               "ignore_eos": True},
                              lora=f"lora{n % a.lora}" if a.lora else None)
            n += 1
        torch.cuda.synchronize()
        profile_prefill = a.profile_prefill and bs == max(sizes)
        with (_profiler() if profile_prefill else contextlib.nullcontext()) as prefill_prof:
            t = time.perf_counter()
            prefill_steps = 0
            while len(sched.running) < bs:  # prefill everything
                sched.step()
                prefill_steps += 1
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t
        entry: dict = {"prefill_s": prefill_s, "prefill_tok_s": bs * a.prompt_len / prefill_s,
                       "prefill_steps": prefill_steps,
                       "graph": bool(gr is not None and gr.can_run(bs))}
        if profile_prefill:
            count, kernel_us, top = _kernels(prefill_prof, a.rows)
            entry["prefill_kernel_s"] = kernel_us / 1e6
            entry["prefill_kernels"] = count
            entry["prefill_profile_top"] = top
            print(f"== prefill of batch {bs} ({bs} x {a.prompt_len} tokens, {prefill_steps} "
                  f"steps, {prefill_s:.2f} s wall, {entry['prefill_kernel_s']:.2f} s of kernels)")
            print(top)
        if a.verify:  # speculation's steps: plain and verify, whole steps (overlap is off)
            from verify_cost import verify_vs_plain

            entry["verify"] = verify_vs_plain(sched, a.verify, a.steps, torch.cuda.synchronize)
            print(f"== batch {bs}, {a.verify} drafts: {json.dumps(entry['verify'])}")
        # the scheduler's overlap off, then on (the GPU default; speculation keeps it off)
        for overlap in (False,) if a.verify else (False, True):
            sched.cfg.overlap = overlap
            step_ms = []
            for _ in range(a.steps):
                t = time.perf_counter()
                sched.step()
                step_ms.append((time.perf_counter() - t) * 1e3)
            entry[f"step_ms_median_overlap_{'on' if overlap else 'off'}"] = \
                statistics.median(step_ms)
        entry["overlapped_steps"] = sched.counters["overlapped_steps"]
        if gr is not None and gr.can_run(bs):
            from core.engine.graphs import pick_bucket

            g = gr.graphs[pick_bucket(bs, gr.sizes)]
            times = []
            for _ in range(a.steps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            entry["replay_ms_median"] = statistics.median(times)
            entry["replay_fraction_of_roofline"] = report["roofline_ms_per_step_b1"] / \
                entry["replay_ms_median"]
        profiled = 8
        with _profiler() as prof:
            for _ in range(profiled):
                sched.step()
            torch.cuda.synchronize()
        count, kernel_us, table = _kernels(prof, a.rows)
        # launches a step and their GPU time (kernels and copies the profiler saw)
        entry["kernels_per_step"] = count / profiled
        entry["kernel_ms_per_step"] = kernel_us / profiled / 1e3
        entry["profile_top"] = table
        print(f"== batch {bs}: "
              f"{json.dumps({k: v for k, v in entry.items() if not k.endswith('profile_top')})}")
        print(table)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(host)
        entry["profile_host"] = host
        report["batches"][bs] = entry
        for r in list(sched.running):
            sched.abort(r.rid)
        sched.step()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "batches"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
