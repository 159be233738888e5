"""A/B of the GGUF product kernel (plugins/quant/gguf/kernels.c): another revision's source
against this tree's, the same ISA variant, in one process, timings interleaved.

    git show REV:plugins/quant/gguf/kernels.c > /tmp/base_kernels.c
    OMP_NUM_THREADS=1 python bench/ab_gguf_linear.py /tmp/base_kernels.c --variant avx2

For SmolLM2-135M's matrix shapes (Q4_1 qkv, gate_up, down; the Q8_0 LM head) and M rows of bf16
input (int16 activations, the default methods'), the best of --rounds timings of a loop of calls
with the weights warm, each round timing the baseline and then this tree. Both builds must give
the same bits (the script checks it first). The ratio is baseline time / this tree's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins._kit.cbuild import build  # noqa: E402
from plugins.quant.gguf import formats  # noqa: E402
from plugins.quant.gguf.kernels import Kernels, library  # noqa: E402

SHAPES = [("qkv", "Q4_1", 960, 576), ("gate_up", "Q4_1", 3072, 576),
          ("down", "Q4_1", 576, 1536), ("lm_head", "Q8_0", 49152, 576)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("baseline", help="a kernels.c of another revision")
    p.add_argument("--variant", default="avx2")
    p.add_argument("--rows", default="1,2,3,4,5,8,16")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    ours = Kernels(a.variant, 16)
    base = Kernels(a.variant, 16)
    lib = build(Path(a.baseline), a.variant)
    ref = library(a.variant)
    lib.gq_linear.argtypes, lib.gq_linear.restype = ref.gq_linear.argtypes, ref.gq_linear.restype
    base.lib = lib
    if base.lib is ours.lib:
        raise SystemExit("the baseline source is this tree's (the same build)")
    print(f"variant {a.variant}, threads {torch.get_num_threads()}")
    print("| shape | M | baseline us | this tree us | baseline / this tree |")
    print("|---|---|---|---|---|")
    for name, t, n, k in SHAPES:
        w = formats.from_ggml(t, formats.random_blocks(t, n, k, seed=1), k)
        fb, fo = base.bind(w), ours.bind(w)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            if not torch.equal(fb(x), fo(x)):
                print(f"| {name} | {m} | different results | | |")
                continue
            reps = max(3, int(2e5 / (n * k / 64 * m)))
            times: dict[str, list[float]] = {"base": [], "ours": []}
            for _ in range(a.rounds):
                for key, f in (("base", fb), ("ours", fo)):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        f(x)
                    times[key].append((time.perf_counter() - t0) / reps * 1e6)
            b, o = min(times["base"]), min(times["ours"])
            print(f"| {name} {t} {n}x{k} | {m} | {b:.1f} | {o:.1f} | {b / o:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
