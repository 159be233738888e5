"""The AMX tile kernels (plugins/quant/gguf/amx.c) against the VNNI int16 kernel and
dequantize-then-F.linear (oneDNN), per shape and number of input rows, on this CPU.

Columns: `bf16t` the bf16-tile kernel (bf16 x, the weights dequantized inside it); `int8t` the
int8-tile kernel (the gguf kernels' int16-activation arithmetic), with bf16 x and with fp32 x;
`vnni` gguf_avx512's kernel (bf16 x); `deq` dequantize + F.linear in bf16 and (`deq32`) fp32.

    python bench/bench_gguf_amx.py [--threads 1,16] [--clock cpu] [--out amx.json]

Shapes: SmolLM2-135M's (Q4_1: qkv 960x576, gate_up 3072x576, down 576x1536) and one
Llama-3-8B-shaped matrix (Q4_0 4096x4096). Each figure is the best of 5 timings of a loop of
calls with warm caches (weights re-read from L2 / memory each call as in a prefill chunk); the
ratios compare paths measured in the same run. Needs a CPU with amx_bf16 and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins.quant.gguf.formats import from_ggml, random_blocks  # noqa: E402
from plugins.quant.gguf.kernels import AmxKernels, Kernels  # noqa: E402

SHAPES = [("qkv", "Q4_1", 960, 576), ("gate_up", "Q4_1", 3072, 576),
          ("down", "Q4_1", 576, 1536), ("llama8b_o", "Q4_0", 4096, 4096)]
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


CLOCK = time.perf_counter  # --clock cpu: this thread's CPU time (one thread only)


def best_ms(f, x, budget_s: float = 0.05) -> float:
    for _ in range(2):
        f(x)
    t = CLOCK()
    f(x)
    reps = max(1, int(budget_s / max(CLOCK() - t, 1e-6)))
    best = float("inf")
    for _ in range(5):
        t = CLOCK()
        for _ in range(reps):
            f(x)
        best = min(best, (CLOCK() - t) / reps)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1")
    p.add_argument("--out", default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time, robust to other load on the box "
                        "(valid with --threads 1 only: the kernels then run on this thread)")
    a = p.parse_args()
    global CLOCK
    if a.clock == "cpu":
        if a.threads != "1":
            p.error("--clock cpu measures one thread: use --threads 1")
        CLOCK = time.thread_time
    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        amx, vnni = AmxKernels(), Kernels("avx512_vnni")  # kernels read the thread count
        for name, gtype, n, k in SHAPES:
            w = from_ggml(gtype, random_blocks(gtype, n, k, seed=1), k)
            fa, fv = amx.bind(w), vnni.bind(w)
            fi = amx.bind_int(w)

            def fd(x, w=w, vnni=vnni):
                return F.linear(x, vnni.dequantize(w, x.dtype))

            for m in ROWS:
                x = torch.randn(m, k).bfloat16()
                x32 = x.float()
                t = {"bf16t": best_ms(fa, x), "int8t": best_ms(fi, x),
                     "int8t_fp32": best_ms(fi, x32), "vnni": best_ms(fv, x),
                     "vnni_fp32": best_ms(fv, x32), "deq": best_ms(fd, x),
                     "deq32": best_ms(fd, x32)}
                gf = 2 * m * n * k / 1e9
                r = {"threads": threads, "shape": name, "type": gtype, "N": n, "K": k, "M": m,
                     **{f"{key}_ms": v for key, v in t.items()}}
                rows.append(r)
                print(f"t={threads:2d} {name:9s} M={m:4d}: " + "  ".join(
                    f"{key} {v:7.3f}" for key, v in t.items()) +
                    f"  | GF/s bf16t {gf / t['bf16t'] * 1e3:5.0f} int8t {gf / t['int8t'] * 1e3:5.0f}"
                    f" | vnni/int8t {t['vnni'] / t['int8t']:5.2f}x"
                    f" deq32/int8t32 {t['deq32'] / t['int8t_fp32']:5.2f}x"
                    f" bf16t/int8t {t['bf16t'] / t['int8t']:5.2f}x", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
