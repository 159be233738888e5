"""Triton vs torch_native extend attention, timed in alternation in one process, on a CUDA GPU.

    python bench/interleaved_extend.py [--rounds 5] [--out interleaved_extend.json]

Times from different runs and lent machines have differed (torch_native's own prefix 4k + new
4k read 1.69-1.94 ms on 2026-11-30, before ceilings.py queued a GPU spin ahead of each timed
call: mostly host launch gaps), so a ratio of two numbers from different runs says little. Here both backends run the same step (bench_attention.py's inputs: Llama-3-8B
attention geometry, bf16, pages of 16 scattered over the pool) in alternating rounds, each
round a median of 10 L2-flushed, CUDA-event-timed calls of `forward` (KV write + attention, as
bench_attention.py times it); reported are the median round and the range, and the matmul
ceiling measured in the same run. Shapes: extend, one request, prefix 0/4096/8192 + 4096 new.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

SHAPES = ((4096, 4096), (0, 4096), (8192, 4096))
BACKENDS = ("torch_native", "triton")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="interleaved_extend.json")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") or not torch.cuda.is_available():
        sys.exit("needs a CUDA device (and TRITON_INTERPRET unset)")
    import bench_attention as ba
    from ceilings import gpu_seconds, measure

    from core.plan.registry import get_registry

    device = torch.device("cuda")
    ceil = measure(device, ba.DTYPE)
    res = dict(ceilings=ceil.as_info(), torch=torch.__version__, rounds=args.rounds, shapes=[])
    print(f"{ceil.device_name}: bf16 matmul {ceil.matmul_flop_per_s / 1e12:.0f} TFLOP/s "
          f"(this run)")
    for prefix, new in SHAPES:
        step = ba._step("extend", 1, prefix, new, device)
        flops = ba._extend_flops(1, prefix, new)
        fns = {}
        for name in BACKENDS:
            backend = get_registry().get("attention", name).load()(step.ctx)
            meta = backend.prepare(step.batch)

            def call(backend=backend, meta=meta, step=step):
                step.batch.attn_backend, step.batch.attn_meta = backend, meta
                return backend.forward(step.q, step.k, step.v, step.layer, step.batch)
            fns[name] = call
        want = fns["torch_native"]().float()
        got = fns["triton"]().float()
        err = (got - want).abs().max().item()
        times = {name: [] for name in BACKENDS}
        for _ in range(args.rounds):
            for name in BACKENDS:
                times[name].append(gpu_seconds(fns[name], device, reps=10))
        row = dict(prefix=prefix, new=new, flops=flops, max_abs_diff=err)
        for name, ts in times.items():
            med = statistics.median(ts)
            row[name] = dict(ms=round(med * 1e3, 4), min_ms=round(min(ts) * 1e3, 4),
                             max_ms=round(max(ts) * 1e3, 4),
                             ratio_to_matmul=round(flops / med / ceil.matmul_flop_per_s, 3))
        row["speedup"] = round(row["torch_native"]["ms"] / row["triton"]["ms"], 3)
        # the least favourable pairing of rounds, for the spread
        row["speedup_worst"] = round(row["torch_native"]["min_ms"] / row["triton"]["max_ms"], 3)
        res["shapes"].append(row)
        print(f"prefix={prefix} new={new}: triton {row['triton']['ms']:.3f} ms "
              f"[{row['triton']['min_ms']:.3f}-{row['triton']['max_ms']:.3f}] "
              f"({row['triton']['ratio_to_matmul']:.2f} of matmul), torch_native "
              f"{row['torch_native']['ms']:.3f} ms [{row['torch_native']['min_ms']:.3f}-"
              f"{row['torch_native']['max_ms']:.3f}]: {row['speedup']:.2f}x (worst pairing "
              f"{row['speedup_worst']:.2f}x); max |diff| {err:.3g}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
