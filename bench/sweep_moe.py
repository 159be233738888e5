"""Sweep the Triton MoE kernels' tilings on a CUDA GPU; print the best per shape and the
tuning-table entries (plugins/moe/triton/tuning.py) they imply.

    python bench/sweep_moe.py                       # writes sweep_moe.json
    python bench/sweep_moe.py --quick --out x.json  # fewer candidates and token counts
    TRITON_INTERPRET=1 python bench/sweep_moe.py --smoke   # the script itself, tiny, on a CPU

Shapes: Qwen3-30B-A3B's experts (128 of width 768 over hidden 2048, top-8) and Mixtral-8x7B's
(8 of width 14336 over 4096, top-2), bf16, token counts from decode (1..64) to prefill (8192);
with --form mxfp4, GPT-OSS-20B's (32 of width 2880 over 2880, top-4) as packed MXFP4 experts
(random codes and biases; GB/s counts their bytes: 17/32 of a byte a weight), multiplied as
--mxfp4-dot says (tl.dot_scaled, or tiles decoded in registers: compare both on the GPU).
Per shape and candidate tiling (block_m, block_n, block_k, warps, stages) it times the whole
runner forward (routing, alignment, both GEMMs, the k-sum) with the L2 flushed before every call
(bench/ceilings.gpu_seconds), and reports TFLOP/s (2 * T * k * 3 * H * I) beside the bf16
matmul rate, and GB/s over the expert bytes touched (every routed expert's w13 and w2 once)
beside the copy bandwidth, both measured in the same run. At the end, per rows-per-expert
bucket of tuning.py, the tiling that loses least over the shapes in it is printed as a TABLE
entry for this GPU's arch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

# name -> (experts, top_k, hidden, intermediate)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
MXFP4_MODELS = {"gpt-oss-20b": (32, 4, 2880, 2880)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192)
QUICK_TOKENS = (1, 8, 64, 1024, 8192)
# (block_m, block_n, block_k, num_warps, num_stages)
TILINGS = [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 64, 4, 4), (16, 128, 128, 4, 3),
           (16, 64, 256, 4, 3), (16, 128, 64, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
           (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
           (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 256, 64, 8, 3)]
QUICK_TILINGS = TILINGS[:3] + TILINGS[8:12]
SMOKE_TILINGS = [(16, 32, 32, 1, 1), (16, 16, 16, 1, 1)]
BUCKETS = (4, 16, 64, None)  # tuning.py's rows-per-expert bounds


def _inputs(experts, top_k, hidden, inter, tokens, dtype, device, seed=0, form="unquantized"):
    from core.contract.moe import MoELayerParams, MoEWeights

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    logits = torch.randn(tokens, experts, device=device, dtype=dtype, generator=g)
    layer = MoELayerParams(0, experts, top_k, hidden, inter)
    if form == "mxfp4":  # packed rows (plugins/_kit/mxfp4.py), scales 2^-9..2^-5
        def packed(n, k):
            return (torch.randint(0, 256, (experts, n, k // 2), device=device, generator=g,
                                  dtype=torch.uint8),
                    torch.randint(118, 123, (experts, n, k // 32), device=device, generator=g,
                                  dtype=torch.uint8))

        (w13, s13), (w2, s2) = packed(2 * inter, hidden), packed(hidden, inter)
        extra = {"w13_scale": s13, "w2_scale": s2,
                 "w13_bias": torch.zeros(experts, 2 * inter, device=device),
                 "w2_bias": torch.zeros(experts, hidden, device=device)}
        return x, logits, MoEWeights(w13, w2, form="mxfp4", extra=extra), layer
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g)
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g)
    w13 *= hidden ** -0.5
    w2 *= inter ** -0.5
    return x, logits, MoEWeights(w13, w2), layer


def _timer(device, smoke):
    if smoke:
        def wall(fn, reps=1):
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return wall
    from ceilings import gpu_seconds

    return lambda fn: gpu_seconds(fn, device, reps=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sweep_moe.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (CI check)")
    ap.add_argument("--form", choices=("unquantized", "mxfp4"), default="unquantized",
                    help="the experts' weight form (mxfp4: GPT-OSS-20B's shapes)")
    ap.add_argument("--mxfp4-dot", choices=("auto", "scaled", "decode"), default="auto",
                    help="--form mxfp4: the kernels' product (TritonMoE's mxfp4_dot)")
    ap.add_argument("--models", default=None,
                    help=f"comma list of {sorted(MODELS)} (--form mxfp4: {sorted(MXFP4_MODELS)})")
    ap.add_argument("--tokens", default=None, help="comma list of token counts")
    ap.add_argument("--tilings", default=None,
                    help="tilings to try, as 'm,n,k,warps,stages;...' (default: the built-in "
                         "list); the table at the end is then only for the shapes swept")
    args = ap.parse_args()
    from core.contract.moe import route
    from plugins.moe.triton.runner import TritonMoE, _arch

    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    models = {"smoke": (16, 4, 64, 32)} if smoke else (
        MXFP4_MODELS if args.form == "mxfp4" else MODELS)
    if args.models:
        unknown = set(args.models.split(",")) - set(models)
        if unknown:
            ap.error(f"unknown models {sorted(unknown)}; known: {sorted(models)}")
        models = {m: models[m] for m in args.models.split(",")}
    tokens_list = (1, 8, 33) if smoke else (QUICK_TOKENS if args.quick else TOKENS)
    if args.tokens:
        tokens_list = tuple(int(t) for t in args.tokens.split(","))
    tilings = SMOKE_TILINGS if smoke else (QUICK_TILINGS if args.quick else TILINGS)
    if args.tilings:
        tilings = [tuple(int(v) for v in t.split(",")) for t in args.tilings.split(";")]
        if any(len(t) != 5 for t in tilings):
            ap.error("a tiling is five integers: block_m,block_n,block_k,warps,stages")
    timer = _timer(device, smoke)
    info = {"device": str(device), "arch": _arch(device), "dtype": str(dtype),
            "form": args.form, "mxfp4_dot": args.mxfp4_dot}
    if not smoke:
        from ceilings import measure

        ceil = measure(device)
        info.update(ceil.as_info())
    rows, results = [], []
    for name, (E, k, H, inter) in models.items():
        for T in tokens_list:
            x, logits, weights, layer = _inputs(E, k, H, inter, T, dtype, device,
                                                form=args.form)
            touched = route(logits, layer)[1].unique().numel()
            flop = 2 * T * k * 3 * H * inter
            per_weight = 17 / 32 if args.form == "mxfp4" else x.element_size()
            nbytes = int(touched * 3 * H * inter * per_weight)
            timed = {}
            for tiling in tilings:
                runner = TritonMoE(tiling=tiling, mxfp4_dot=args.mxfp4_dot)
                try:
                    seconds = timer(lambda r=runner, a=(x, logits, weights, layer): r.forward(*a))
                except Exception as exc:  # a tiling this GPU cannot run (shared memory, ...)
                    print(f"  {name} T={T} {tiling}: {type(exc).__name__}: {exc}"[:160])
                    continue
                timed[tiling] = seconds
            if not timed:
                continue
            best = min(timed, key=timed.get)
            t = timed[best]
            row = {"model": name, "tokens": T, "rows_per_expert": T * k / E,
                   "best": list(best), "us": round(t * 1e6, 1),
                   "TFLOPs": round(flop / t / 1e12, 2), "GBps": round(nbytes / t / 1e9, 1),
                   "all_us": {",".join(map(str, c)): round(s * 1e6, 1) for c, s in timed.items()}}
            if not smoke:
                row["of_matmul"] = round(flop / t / ceil.matmul_flop_per_s, 3)
                row["of_copy_bw"] = round(nbytes / t / ceil.copy_bytes_per_s, 3)
            rows.append(row)
            results.append((T * k / E, timed))
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "all_us"}))
    table = []
    lower = 0.0
    for bound in BUCKETS:
        inside = [timed for rpe, timed in results
                  if rpe > lower and (bound is None or rpe <= bound)]
        lower = bound if bound is not None else lower
        common = set.intersection(*(set(t) for t in inside)) if inside else set()
        if not common:
            continue
        # least summed loss against each shape's best
        pick = min(common, key=lambda c: sum(t[c] / min(t.values()) for t in inside))
        table.append((bound, pick))
    entry = ", ".join(f"({b}, {p})" for b, p in table)
    print(f'\ntuning.TABLE["{info["arch"]}"] = ({entry},)')
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows,
                                          "table": [[b, list(p)] for b, p in table]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        sys.exit("no GPU: run on a CUDA machine, or with TRITON_INTERPRET=1 --smoke")
    main()
