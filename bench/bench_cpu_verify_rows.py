"""cpu_c's short-extend path (a speculative verify step run as decode rows through the C kernel)
against torch_native's gather + dense prefill, one layer on the CPU.

    OMP_NUM_THREADS=1 python bench/bench_cpu_verify_rows.py [--backend cpu_c_avx2] [--reps 7]

One request, SmolLM2's attention shape (9 query / 3 KV heads of 64), --dtype bf16 (default) or
fp32 (the rows path forced on for either, whatever the build ships), pages of 16, prefixes
512 / 4k / 16k and 2 / 5 / 16 new tokens. Per row: the median wall time of the backend's
forward with the rows path (plugins.attention.cpu_c.backend.SHORT_EXTEND = 16) and with it off
(0: the prefill path), and their ratio. The peer is the same backend's other path in the same
run: the question is what exact agreement with decode costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import plugins.attention.cpu_c.backend as cpu_c
    from conformance.attention_check import run_backend
    from conformance.paged_batch import AttentionCase, build_inputs
    from core.plan.registry import get_registry

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu_c", help="a cpu_c build: cpu_c, cpu_c_avx2, ...")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args(argv)
    reg = get_registry().get("attention", a.backend)
    cls = reg.load()
    shipped, shipped_dtypes = cpu_c.SHORT_EXTEND, cls.rows_dtypes
    cls.rows_dtypes = (torch.bfloat16, torch.float32)
    print(f"{a.backend}, {a.dtype}, {torch.get_num_threads()} thread(s)")
    print("| prefix | new tokens | rows ms | prefill ms | rows / prefill |\n|---|---|---|---|---|")
    try:
        for prefix in (512, 4096, 16384):
            for new in (2, 5, 16):
                case = AttentionCase("extend", 3, 3, 64, 16, a.dtype, a.dtype,
                                     (prefix + new,), (new,))
                inputs = build_inputs(case, "cpu", seed=1)
                ms = {}
                for path, limit in (("rows", 16), ("prefill", 0)):
                    cpu_c.SHORT_EXTEND = limit
                    backend = cls(inputs.ctx)
                    times = []
                    for _ in range(a.reps):
                        t = time.perf_counter()
                        run_backend(backend, inputs)
                        times.append(time.perf_counter() - t)
                    ms[path] = statistics.median(times) * 1e3
                print(f"| {prefix} | {new} | {ms['rows']:.3f} | {ms['prefill']:.3f} | "
                      f"{ms['rows'] / ms['prefill']:.2f} |", flush=True)
    finally:
        cpu_c.SHORT_EXTEND, cls.rows_dtypes = shipped, shipped_dtypes
    return 0


if __name__ == "__main__":
    sys.exit(main())
