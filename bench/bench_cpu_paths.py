"""The engine's CPU paths side by side on the default model: prefill and decode per quant method
and dtype, measured by the engine worker's own CPU time (robust to other load on the box).

    python bench/bench_cpu_paths.py gguf_amx:bfloat16 gguf_avx512:bfloat16 gguf_amx:float32 \
        gguf_avx512:float32 [--threads 1] [--reps 5] [--out paths.json]

Each PATH is QUANT:DTYPE (QUANT `auto`: the resolver's choice). Per path, one `core.Engine`
(one engine worker, --threads torch/OpenMP threads) runs, after a warm-up of each kind:
- pp512: a 512-token prompt (random ids, seeded) and 1 new token, the prefix cache flushed;
- tg64: a 16-token prompt and 64 new tokens, greedy, EOS ignored.
The figures are the engine worker's user + system CPU seconds for the request (/proc/PID/stat;
with one thread they are its compute time whatever else runs on the box; with more, the sum
over its threads) and the wall time, min / median of --reps runs. Ratios compare paths measured
in the same run only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench_cpu_peers import proc_cpu_s  # this directory: sys.path[0] when run as a script


def measure(path: str, threads: int, reps: int, prompts: dict[int, list[int]]) -> dict:
    import core
    from core.plan.default_model import default_model_path

    quant, _, dtype = path.partition(":")
    kw = {} if quant in ("", "auto") else {"quantization": quant}
    eng = core.Engine(default_model_path(), dtype=dtype or "auto", device="cpu",
                      max_total_tokens=8192, **kw)
    try:
        pid = eng.client.process.pid

        def run(ids: list[int], new: int) -> tuple[float, float]:
            sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
            eng.flush_cache()
            c0, t0 = proc_cpu_s(pid), time.perf_counter()
            got = sum(len(c["token_ids"]) for c in
                      eng.generate(input_ids=ids, sampling_params=sp, stream=True))
            if got != new:
                raise RuntimeError(f"asked for {new} tokens, got {got}")
            return time.perf_counter() - t0, proc_cpu_s(pid) - c0

        out = {"path": path, "quant_method": eng.plan.quant_method, "dtype": eng.plan.dtype,
               "threads": threads}
        for name, ids, new in (("pp512", prompts[512], 1), ("tg64", prompts[16], 64)):
            run(ids, new)  # warm-up
            runs = [run(ids, new) for _ in range(reps)]
            out[name] = {"wall_s_median": statistics.median(w for w, _ in runs),
                         "cpu_s_min": min(c for _, c in runs),
                         "cpu_s_median": statistics.median(c for _, c in runs)}
        return out
    finally:
        eng.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="QUANT:DTYPE, e.g. gguf_amx:bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the spawned engine worker reads it
    rng = random.Random(a.seed)
    prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in (16, 512)}
    rows = []
    for path in a.paths:
        r = measure(path, a.threads, a.reps, prompts)
        rows.append(r)
        print(f"{path:24s} -> {r['quant_method']} {r['dtype']}: "
              f"pp512 cpu {r['pp512']['cpu_s_min'] * 1e3:7.0f} ms "
              f"(wall {r['pp512']['wall_s_median'] * 1e3:6.0f}) | "
              f"tg64 cpu {r['tg64']['cpu_s_min']:6.2f} s (wall {r['tg64']['wall_s_median']:5.2f})",
              flush=True)
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['path']:24s} / {base['path']}: pp512 "
              f"{r['pp512']['cpu_s_min'] / base['pp512']['cpu_s_min']:.2f}x the CPU time, tg64 "
              f"{r['tg64']['cpu_s_min'] / base['tg64']['cpu_s_min']:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime()),
                                           "command": " ".join(sys.argv), "rows": rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
