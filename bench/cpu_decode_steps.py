"""Milliseconds a batch-1 decode step of the default model takes on this CPU, in-process (a
diagnostic for A/B comparisons of two checkouts on a noisy VM, not a benchmark).

    python bench/cpu_decode_steps.py                      # this checkout
    python bench/cpu_decode_steps.py --repo /tmp/base     # another checkout (git worktree)
    python bench/cpu_decode_steps.py --model-path F.gguf --threads 1,4,16   # a thread sweep
    python bench/cpu_decode_steps.py --quantization gguf_avx512,gguf_avx512_q8 --rounds 3
                                                          # methods A/B, interleaved rounds
    python bench/cpu_decode_steps.py --graphs on,off --rounds 3   # CPU decode graphs A/B
    python bench/cpu_decode_steps.py --graphs on,off --batch 1,4,16  # decode batches of N

Builds the engine core in this process (no worker, no server), prefills --batch 128-token
prompts and runs --steps greedy decode steps of them, EOS ignored; prints steps per second
over the whole loop (the prefill included), and the median decode step with its output tokens
per second. Run two checkouts interleaved, several times, and compare
only those runs with each other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

PROMPT = 128  # tokens in each request's prompt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--model-path", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--threads", default=None,
                   help="comma-separated torch thread counts: one engine and one measurement "
                        "each (kernels read the count when they are built)")
    p.add_argument("--quantization", default=None,
                   help="comma-separated quant methods (e.g. gguf_avx512,gguf_avx512_q8): one "
                        "engine each, measured in turn for --rounds rounds")
    p.add_argument("--graphs", default="on",
                   help="comma-separated on/off: decode graphs (off = --disable-cuda-graph), "
                        "one engine each, measured in turn like --quantization")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batch", default="1",
                   help="comma-separated decode batch sizes: N requests at once (each its own "
                        "128-token prompt), measured in turn within each round")
    a = p.parse_args(argv)
    sys.path.insert(0, a.repo)
    from core.engine.loader import load_model
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    methods = [(m, g) for m in (a.quantization.split(",") if a.quantization else [None])
               for g in a.graphs.split(",")]
    for threads in (a.threads.split(",") if a.threads else [None]):
        if threads is not None:
            import torch
            torch.set_num_threads(int(threads))
        # every method's engine built first, then measured in turn: rounds interleave them
        cores = {m: build(a, m, load_model, build_engine_core, make_plan, make_server_args)
                 for m in methods}
        for _ in range(a.rounds):
            for batch in (int(b) for b in a.batch.split(",")):
                for m, core in cores.items():
                    measure(a, core, threads, m, batch)
    return 0


def build(a, method_graphs, load_model, build_engine_core, make_plan, make_server_args):
    method, graphs = method_graphs
    extra = {"model_path": a.model_path} if a.model_path else {}
    if graphs not in ("on", "off"):
        raise SystemExit(f"--graphs takes on / off, not {graphs!r}")
    extra["disable_cuda_graph"] = graphs == "off"
    if method:
        extra["quantization"] = method
    args = make_server_args(device="cpu", max_total_tokens=4096, dtype=a.dtype,
                            disable_overlap_schedule=True, **extra)
    args, plan, spec, registry = make_plan(args)
    return build_engine_core(args, plan, spec, registry, load_model(args, plan, registry))


def measure(a, core, threads, method_graphs, batch: int = 1) -> None:
    method, graphs = method_graphs
    sched = core.scheduler

    def run(n: int, rid: str) -> tuple[float, int, list[float]]:
        for i in range(batch):  # distinct prompts: no prefix shared through the radix cache
            sched.add_request(f"{rid}-{i}", list(range(100 + 200 * i, 100 + 200 * i + PROMPT)),
                              {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        t, times = time.perf_counter(), []
        while sched.has_work:
            s = time.perf_counter()
            sched.step()
            times.append(time.perf_counter() - s)
        return time.perf_counter() - t, len(times), times

    run(8, "warm-up")
    dt, steps, times = run(a.steps, "measured")
    # decode steps only: the prefill (one chunk of up to 2048 tokens a step) and the last step
    # left out; the median, robust to a noisy neighbour
    prefill = -(-batch * PROMPT // 2048)
    med = statistics.median(times[prefill:-1])
    print(f"{a.repo} threads={threads or 'default'} {method or 'default method'} graphs "
          f"{graphs} batch {batch}: {steps} steps in {dt:.2f} s: {steps / dt:.1f} steps/s, "
          f"{1000 * dt / steps:.2f} ms a step; decode median {1000 * med:.2f} ms a step, "
          f"{batch / med:.1f} tokens/s", flush=True)

if __name__ == "__main__":
    sys.exit(main())
