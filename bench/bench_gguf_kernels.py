"""GGUF block kernels (plugins/quant/gguf) against the dense products they replace, on this CPU.

    python bench/bench_gguf_kernels.py --out gguf_kernels.json

For SmolLM2-135M's matrix shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
LM head 49152x576 in Q8_0) and M = 1..512 rows of input, in one run:
- the kernel of each ISA variant this CPU runs with int16 activations (the default) and int8
  ones (the `_q8` methods), weights cold (a rotation of copies larger than the last-level
  cache, as in a decode step that streams every layer once);
- dequantize-then-F.linear of the same matrix (a prefill path the engine does not take: it
  would make a request's numerics depend on its batch) and the oneDNN-packed bf16 product
  (what `--quantization unquantized` runs);
- the ceiling: copy bandwidth measured now (read + write bytes / s), and each kernel's bytes
  read per second as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins._kit.cbuild import ISA_FEATURES  # noqa: E402
from plugins.quant.gguf import formats  # noqa: E402
from plugins.quant.gguf.formats import random_blocks  # noqa: E402
from plugins.quant.gguf.kernels import Kernels  # noqa: E402

SHAPES = [("qkv", "Q4_1", 960, 576), ("o", "Q4_1", 576, 576), ("gate_up", "Q4_1", 3072, 576),
          ("down", "Q4_1", 576, 1536), ("lm_head", "Q8_0", 49152, 576)]


def cpu_flags() -> set[str]:
    from plugins.hardware.cpu import read_cpuinfo

    info = read_cpuinfo() or {}
    return set((info.get("flags") or info.get("Features") or "").split())


def copy_bandwidth() -> float:
    src = torch.empty(2**26)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * src.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_per_call(fns, x, reps: int) -> float:
    """Median over `reps` sweeps of the mean time per call, cycling through `fns` (cold)."""
    for fn in fns:
        fn(x)
    sweeps = []
    for _ in range(reps):
        t = time.perf_counter()
        for fn in fns:
            fn(x)
        sweeps.append((time.perf_counter() - t) / len(fns))
    return statistics.median(sweeps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16,64,256,512")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-bytes", type=float, default=64e6,
                   help="bytes of weight copies cycled through per measurement")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from plugins.hardware.cpu_runtime import onednn_linear, onednn_pack

    flags = cpu_flags()
    # kernels.c's variants (amx.c has its own bench: bench/bench_gguf_amx.py)
    variants = [v for v, need in ISA_FEATURES.items() if need <= flags and v != "amx"]
    bw = copy_bandwidth()
    report = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "copy_GBps": bw / 1e9, "variants": variants,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s, threads {torch.get_num_threads()}, "
          f"variants {variants}")
    print("| shape | M | int16-act kernel us (variant) | GB/s | of copy | int8-act us | "
          "dequant+linear us | onednn bf16 us | onednn / kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, type_name, n, k in SHAPES:
        copies = max(1, int(a.cold_bytes // (n * k)))
        packed = [formats.from_ggml(type_name, random_blocks(type_name, n, k, i), k)
                  for i in range(copies)]
        nbytes = packed[0].nbytes()
        dense = [onednn_pack(formats.dequantize_ref(w).bfloat16()) for w in packed[:max(1, copies // 2)]]
        kern = {(v, bits): Kernels(v, bits) for v in variants for bits in (16, 8)}
        for m in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(m, k).bfloat16()
            row = {"shape": name, "type": type_name, "n": n, "k": k, "m": m, "bytes": nbytes}
            for (v, bits), kk in kern.items():
                fns = [kk.bind(w) for w in packed]
                row[f"kernel_us_{v}_a{bits}"] = median_per_call(fns, x, a.reps) * 1e6
            best = variants[0]
            dq = kern[(best, 16)].dequantize
            deq = [lambda x, w=w, dq=dq: torch.nn.functional.linear(x, dq(w, x.dtype))
                   for w in packed[:4]]
            row["dequant_linear_us"] = median_per_call(deq, x, a.reps) * 1e6
            row["onednn_bf16_us"] = median_per_call(
                [lambda x, w=w: onednn_linear(x, w) for w in dense], x, a.reps) * 1e6
            t = row[f"kernel_us_{best}_a16"]
            t8 = row[f"kernel_us_{best}_a8"]
            row["GBps"] = nbytes / t / 1e3
            row["of_copy"] = row["GBps"] * 1e9 / bw
            row["kernel_over_onednn"] = row["onednn_bf16_us"] / t
            report["rows"].append(row)
            print(f"| {name} {type_name} {n}x{k} | {m} | {t:.1f} ({best}) | {row['GBps']:.1f} | "
                  f"{row['of_copy']:.2f} | {t8:.1f} | {row['dequant_linear_us']:.1f} | "
                  f"{row['onednn_bf16_us']:.1f} | {row['kernel_over_onednn']:.2f}x |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
