"""Where a speculative verify step's time goes on the CPU, against a plain decode step (a
diagnostic for bench_spec_cpu.py's missed targets, not a benchmark).

    OMP_NUM_THREADS=1 python bench/spec_step_profile.py [--dtype float32] [--quantization Q]

Builds the engine core in this process (no worker), one thread, and for one input-grounded
prompt of bench/spec_prompts.py (a paragraph to repeat) runs its greedy answer twice: with
speculation off and with ngram. Per run: scheduler steps, forwards by kind (decode / verify),
ms per step, and torch.profiler's top operators by self CPU time per step (the model's
kernels, the sampler, the Python between them show up as operators or as the gap to the
step's wall time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    p.add_argument("--quantization", default=None)
    p.add_argument("--prompt", default="repeat_river")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    import torch
    from spec_prompts import SETS

    from core.engine.loader import load_model, load_tokenizer
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    torch.set_num_threads(1)
    msgs = next(x for s in SETS.values() for x in s if x["name"] == a.prompt)["messages"]
    for alg in (None, "ngram"):
        kw = {k: v for k, v in (("dtype", a.dtype), ("quantization", a.quantization),
                                ("speculative_algorithm", alg)) if v}
        args = make_server_args(device="cpu", max_total_tokens=4096,
                                disable_overlap_schedule=True, **kw)
        tok = load_tokenizer(args)
        ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
        args, plan, spec, registry = make_plan(args)
        core = build_engine_core(args, plan, spec, registry, load_model(args, plan, registry))
        sched = core.scheduler
        runner = sched.runner

        def run(rid: str, prof: torch.profiler.profile | None = None,
                sched=sched, ids=ids) -> tuple[float, int]:
            sched.add_request(rid, ids, {"max_new_tokens": a.max_new_tokens, "temperature": 0})
            sched.step()  # the prefill, outside the timing
            t, steps = time.perf_counter(), 0
            while sched.has_work:
                sched.step()
                steps += 1
            return time.perf_counter() - t, steps

        run("warm-up")
        before = dict(runner.forward_count)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dt, steps = run("measured")
        fwd = {k: v - before.get(k, 0) for k, v in runner.forward_count.items()
               if v - before.get(k, 0)}
        print(f"\n=== speculation {alg or 'off'} ({plan.quant_method}, {plan.dtype}): {steps} "
              f"steps after the prefill in {dt:.2f} s = {1e3 * dt / steps:.2f} ms a step "
              f"(profiled); forwards {fwd}")
        dt2, steps2 = run("again")
        print(f"    unprofiled: {steps2} steps in {dt2:.2f} s = {1e3 * dt2 / steps2:.2f} ms a step")
        avg = prof.key_averages()
        ops_ms = sum(e.self_cpu_time_total for e in avg) / 1e3 / steps
        print(f"    torch operators (self CPU time, all): {ops_ms:.2f} ms/step; the rest of the "
              f"profiled step, {1e3 * dt / steps - ops_ms:.2f} ms, is outside torch's operators "
              f"(the quantized GEMM's C kernels, the C decode attention, Python)")
        rows = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:a.top]
        for e in rows:
            print(f"    {e.key[:60]:60s} {e.count / steps:6.1f} calls/step "
                  f"{e.self_cpu_time_total / 1e3 / steps:7.3f} ms/step")
        del core, sched, runner
    return 0


if __name__ == "__main__":
    sys.exit(main())
