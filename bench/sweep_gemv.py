"""Sweep the `linear` layer op's few-row kernel (plugins/ops/triton/gemv.py) against F.linear
(cuBLAS) on a CUDA GPU, at decode shapes; print the best tile per shape and what it implies.

    python bench/sweep_gemv.py --out sweep_gemv.json
    python bench/sweep_gemv.py --quick          # the current TILES entry and a few others

Shapes: Qwen3-30B-A3B's qkv / o / router, Llama-3.1-8B's qkv / o / gate_up / down, bf16, at
1 (and 4) rows. Each timing is a CUDA graph of one call per copy of the weight, as many copies
as make ~256 MB (so, as in a model, every call streams its weight from HBM, not L2), replayed;
GB/s = weight bytes / time per call, beside the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {  # name -> (N, K)
    "qwen3moe_qkv": (5120, 2048), "qwen3moe_o": (2048, 4096), "qwen3moe_router": (128, 2048),
    "llama8b_qkv": (6144, 4096), "llama8b_o": (4096, 4096), "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
}
# (BLOCK_N, BLOCK_K, num_warps, programs per SM)
TILES = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 4, 8)))


def time_per_call(fn, weights, x, reps: int = 10) -> float:
    """Seconds per call: a graph of one call per weight copy, replayed `reps` times."""
    for w in weights[:2]:
        fn(x, w)  # compile / warm up eagerly (the split counts are made here)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            fn(x, w)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / reps / len(weights)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1,4")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: needs CUDA")
        return 0
    from ceilings import copy_bandwidth

    from plugins.ops.triton import gemv

    bw = copy_bandwidth(torch.device("cuda"))
    tiles = TILES if not a.quick else [gemv.TILES["sm90"], (8, 512, 4, 4), (32, 256, 4, 4),
                                       (16, 512, 8, 4), (16, 256, 4, 8)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_GBps": bw / 1e9, "shapes": {}}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, (256 << 20) // nbytes)
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
                   for _ in range(copies)]
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = time_per_call(lambda x, w: F.linear(x, w), weights, x)
            rows = []
            for t in tiles:
                cfg = gemv.config(n, k, dev, t)
                try:
                    sec = time_per_call(lambda x, w, cfg=cfg: gemv.gemv(x, w, None, cfg),
                                        weights, x)
                except Exception as exc:  # a tile the compiler refuses: noted, skipped
                    print(f"  {name} m={m} {t}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                rows.append((sec, t, cfg["SPLIT_K"]))
            rows.sort()
            best = rows[0]
            diff = (gemv.gemv(x, weights[0], None, gemv.config(n, k, dev, best[1])).float()
                    - F.linear(x, weights[0]).float()).abs().max().item()
            entry = {"m": m, "cublas_us": ref * 1e6, "cublas_of_copy": nbytes / ref / bw,
                     "best_tile": best[1], "best_split": best[2], "best_us": best[0] * 1e6,
                     "best_of_copy": nbytes / best[0] / bw, "speedup": ref / best[0],
                     "max_abs_diff": diff,
                     "current_tile_us": next((r[0] * 1e6 for r in rows
                                              if r[1] == gemv.TILES["sm90"]), None),
                     "top5": [(r[0] * 1e6, r[1], r[2]) for r in rows[:5]]}
            report["shapes"][f"{name}_m{m}"] = entry
            print(f"{name:18s} m={m} N={n} K={k}: cuBLAS {ref * 1e6:6.1f} us "
                  f"({entry['cublas_of_copy']:.2f} of copy), best {best[0] * 1e6:6.1f} us "
                  f"({entry['best_of_copy']:.2f}) tile {best[1]} split {best[2]}, x"
                  f"{entry['speedup']:.2f}; current tile {entry['current_tile_us']}")
        del weights
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
