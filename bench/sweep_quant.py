"""Tile sweep of the W8A8 Triton kernels (plugins/quant/w8a8_triton.py) at Llama-3.1-8B shapes.

    python bench/sweep_quant.py --out sweep_quant.json

Decode (M = 1, 16): `small_m_linear` over BLOCK_N x SPLIT_K x num_stages, fp8 per-channel
(per-token activations) and fp8 block-wise (per-group activations). Prefill (M = 4096):
`scaled_mm` over BLOCK_M x BLOCK_N x num_warps x num_stages, fp8 block-wise and int8 per-row.
Each timing is the median of CUDA-graph replays (bench_quant_gemm.timed); every row also shows
the default config's time, so the table's gain over the defaults is read from one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_quant_gemm import SHAPES, timed  # noqa: E402


def _fp8_operands(n: int, k: int, m: int, block: bool):
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn)
    ws = (torch.rand(-(-n // 128), k // 128, device="cuda") if block
          else torch.rand(n, 1, device="cuda")) + 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return x, w, ws


def sweep_decode(rows: list) -> None:
    from plugins.quant.w8a8_triton import small_m_linear

    configs = [dict(BLOCK_N=bn, SPLIT_K=sk, num_warps=4, num_stages=st)
               for bn, sk, st in itertools.product((16, 32, 64), (1, 2, 4, 8, 16), (3, 5))]
    for (shape, (n, k)), m, block in itertools.product(
            [s for s in SHAPES.items() if s[0] != "square"], (1, 16), (False, True)):
        x, w, ws = _fp8_operands(n, k, m, block)
        act, blk = ("group", (128, 128)) if block else ("token", None)
        default = timed(partial(small_m_linear, x, w, ws, None, act, blk))
        best = None
        for cfg in configs:
            try:
                t = timed(partial(small_m_linear, x, w, ws, None, act, blk, config=cfg),
                          reps=20)
            except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run
                print(f"  {shape} M={m} {cfg}: {type(exc).__name__}", flush=True)
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        gbps = n * k / best[0] / 1e9
        row = {"kind": "decode", "format": "fp8_block" if block else "fp8_channel",
               "shape": shape, "N": n, "K": k, "M": m, "default_us": default * 1e6,
               "best_us": best[0] * 1e6, "best": best[1], "best_weight_GBps": gbps}
        rows.append(row)
        print(json.dumps(row), flush=True)


def sweep_prefill(rows: list) -> None:
    from plugins.quant.w8a8_triton import scaled_mm

    configs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=st)
               for bm, bn, nw, st in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))]
    m = 4096
    for (shape, (n, k)), fmt in itertools.product(SHAPES.items(), ("fp8_block", "int8")):
        if fmt == "fp8_block":
            a = (torch.randn(m, k, device="cuda")).to(torch.float8_e4m3fn)
            sa = torch.rand(m, k // 128, device="cuda") + 0.5
            b = (torch.randn(n, k, device="cuda")).to(torch.float8_e4m3fn)
            sb = torch.rand(n // 128, k // 128, device="cuda") + 0.5
            gn, gk = 128, 128
        else:
            a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
            b = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
            sa, sb = torch.rand(m, 1, device="cuda"), torch.rand(n, 1, device="cuda")
            gn, gk = 1, k
        fn = partial(scaled_mm, a, sa, b, sb, gn, gk, torch.bfloat16)
        default = timed(fn, reps=10)
        best = None
        for cfg in configs:
            try:
                t = timed(partial(fn, config=cfg), reps=10)
            except Exception as exc:  # noqa: BLE001
                print(f"  {shape} {fmt} {cfg}: {type(exc).__name__}", flush=True)
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        row = {"kind": "prefill", "format": fmt, "shape": shape, "N": n, "K": k, "M": m,
               "default_us": default * 1e6, "best_us": best[0] * 1e6, "best": best[1],
               "best_tflops": 2 * m * n * k / best[0] / 1e12}
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=("decode", "prefill"), default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    rows: list = []
    try:
        if a.only in (None, "decode"):
            sweep_decode(rows)
        if a.only in (None, "prefill"):
            sweep_prefill(rows)
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
