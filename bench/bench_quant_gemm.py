"""GEMM comparison of the quant methods' kernels at Llama-3.1-8B shapes, one run, one GPU.

    python bench/bench_quant_gemm.py --out quant_gemm.json

For decode (M = 1, 16) and prefill (M = 4096) sizes of the model's four projections, and the
square 4096^3: bf16 `F.linear` (the peer), fp8 per-channel W8A8 (`torch._scaled_mm`, activation
quantization included), fp8 block-wise (the Triton block GEMM, activation quantization
included), int8 W8A8 (the plugin's Triton kernels), and the int4 weight-only kernels where the
int4 plugin is installed. Each figure: median time of CUDA-event-timed replays of a CUDA graph
of one call (as decode steps run), TFLOP/s, weight GB/s, and ratios to bf16 and to the ceilings measured in the same run (bf16 matmul
TFLOP/s at 8192^3, device-to-device copy GB/s). Prints a markdown table; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "square": (4096, 4096)}
MS = (1, 16, 4096)


def timed(fn, reps: int = 50, graph: bool = True) -> float:
    """Median seconds of fn() over CUDA-event-timed repeats (after warm-up), replayed from a
    CUDA graph as the engine's decode steps are (a method's several launches then cost GPU
    time, not Python time); eager where capture fails."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            torch.cuda.synchronize()
            run = fn
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ a, reps=5, graph=False)
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    tc = timed(lambda: dst.copy_(src), reps=5, graph=False)
    return {"bf16_matmul_tflops": 2 * 8192**3 / t / 1e12, "copy_GBps": 2 * src.numel() * 2 / tc / 1e9}


def layer_for(method_name: str, n: int, k: int):
    """A Linear of [n, k] under one quant method, loaded with random weights (dense, quantized
    at load where the method does that; the int4 methods from their own packer)."""
    from core.contract.quant import online_scheme, parse_quant_config
    from core.layers import Linear, ModelContext
    from core.layers.linear import process_weights_after_loading
    from core.plan.registry import get_registry

    registry = get_registry()
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if method_name in ("fp8", "w8a8_int8"):
        fmt = "fp8_channel" if method_name == "fp8" else "int8_channel"
        method = registry.get("quant", method_name).load()(online_scheme(fmt))
        layer = Linear(k, n, False, ModelContext(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                 quant_method=method))
        layer.weight.data.copy_(w)
    elif method_name == "fp8_block":
        from conformance.quant_refs import _ct_quantize
        scheme = parse_quant_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]})
        method = registry.get("quant", "fp8").load()(scheme)
        layer = Linear(k, n, False, ModelContext(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                 quant_method=method))
        q, scale, _ = _ct_quantize(w.float().cpu(), "float", "block", (128, 128))
        layer.weight.data.copy_(q.cuda())
        layer.weight_scale_inv.data.copy_(scale.cuda())
    else:  # int4: the plugin's reference packer
        from conformance import quant_refs_int4 as refs
        case = next(c for c in refs.CASES if c.format == f"int4_{method_name}")
        method = registry.get("quant", method_name).load()(parse_quant_config(case.config))
        layer = Linear(k, n, False, ModelContext(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                 quant_method=method))
        tensors, _ = case.build(w.float().cpu())
        for name, t in tensors.items():
            getattr(layer, name).data.copy_(t.cuda())
    process_weights_after_loading(layer)
    return layer, w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--methods", default="bf16,fp8,fp8_block,w8a8_int8,awq,gptq")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    ceil = ceilings()
    rows = []
    bytes_per = {"bf16": 2, "fp8": 1, "fp8_block": 1, "w8a8_int8": 1, "awq": 0.5, "gptq": 0.5}
    for shape, (n, k) in SHAPES.items():
        for m in MS:
            if shape == "square" and m != 4096:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = None
            for name in a.methods.split(","):
                try:
                    if name == "bf16":
                        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                        t = timed(partial(torch.nn.functional.linear, x, w))
                    else:
                        layer, _ = layer_for(name, n, k)
                        t = timed(partial(layer, x))
                except Exception as exc:  # noqa: BLE001 - a missing plugin loses one row
                    rows.append({"shape": shape, "M": m, "method": name,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                tflops = 2 * m * n * k / t / 1e12
                gbps = n * k * bytes_per[name] / t / 1e9
                if name == "bf16":
                    base = t
                rows.append({"shape": shape, "N": n, "K": k, "M": m, "method": name,
                             "us": t * 1e6, "tflops": tflops, "weight_GBps": gbps,
                             "vs_bf16": (base / t) if base else None,
                             "of_matmul_peak": tflops / ceil["bf16_matmul_tflops"],
                             "of_copy_bw": gbps / ceil["copy_GBps"]})
                torch.cuda.empty_cache()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ceilings": ceil, "rows": rows}
    print(f"ceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, copy "
          f"{ceil['copy_GBps']:.0f} GB/s")
    print("| shape | M | method | us | TFLOP/s | weight GB/s | x bf16 | of copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['M']} | {r['method']} | error: {r['error']} |")
            continue
        vs = f"{r['vs_bf16']:.2f}" if r["vs_bf16"] else "-"
        print(f"| {r['shape']} {r['N']}x{r['K']} | {r['M']} | {r['method']} | {r['us']:.1f} | "
              f"{r['tflops']:.1f} | {r['weight_GBps']:.0f} | {vs} | {r['of_copy_bw']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
