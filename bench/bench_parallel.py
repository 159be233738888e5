"""Tensor- and data-parallel scaling of the engine, each figure a ratio to one rank / one
replica measured in the same run.

    # the multi-GPU run (issue 18): Llama-3.1-8B shapes, dummy bf16 weights
    python bench/bench_parallel.py --tp-sizes 1,2,4 --dp-sizes 1,2 --out parallel.json
    # Llama-3.1-70B shapes at TP=4 (batch 1 only), or any HF config.json
    python bench/bench_parallel.py --config tests/fixtures/configs/llama-3.1-70b.json \
        --tp-sizes 4 --dp-sizes 1 --out p70b.json
    # here, on the CPU with gloo (correctness, not speed: two cores do not scale)
    python bench/bench_parallel.py --scenario cpu --tp-sizes 1,2 --dp-sizes 1,2

TP: batch-1 decode (one request, bench_serving's batch1 mode: median time per output token)
at each --tp-sizes value; `speedup` = decode tok/s over the TP=1 figure, `efficiency` =
speedup / tp. With --tp-sizes lacking 1, the ratio is to the smallest size given. Beside it, the
weights-only roofline of one rank: copy bandwidth x ranks / weight bytes (each rank streams its
share), and the fraction of it reached.
DP: offline throughput (bench_serving's offline mode: --num-prompts x --input-len /
--output-len, all submitted at once) at each --dp-sizes value, output tok/s over DP=1's.
Every other flag is bench_serving's (dtype, lengths, --quantization, --max-total-tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (  # noqa: E402
    bench_engine,
    copy_bandwidth,
    make_model_dir,
    parse_args,
    weight_bytes,
)
from cli_lists import int_list  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--dp-sizes", default="1,2")
    p.add_argument("--config", default=None, help="HF config.json (default: bench_serving's: "
                   "Llama-3.1-8B on the GPU, a tiny Llama on the CPU)")
    own, rest = p.parse_known_args(argv)
    a = parse_args([*rest, "--skip-hf"])
    tps = int_list(p, "--tp-sizes", own.tp_sizes)
    dps = int_list(p, "--dp-sizes", own.dp_sizes)
    gpu = a.scenario == "gpu"
    if gpu and not torch.cuda.is_available():
        print("skipped: the gpu scenario needs CUDA (try --scenario cpu)")
        return 0
    if own.config:
        a.cfg = json.loads(Path(own.config).read_text())
    model_dir = make_model_dir(a.cfg)
    dtype_bytes = torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    wbytes = weight_bytes(a.cfg, dtype_bytes)
    bw = copy_bandwidth(a.device)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "devices": torch.cuda.device_count() if gpu else 1, "torch": torch.__version__,
        "copy_bw_GBps": bw / 1e9, "weight_bytes": wbytes, "tp": {}, "dp": {}}
    for tp in tps:
        res = bench_engine(model_dir, a, batch1=True, engine_flags={"tp_size": tp})
        b1 = res["batch1"]
        roof = bw * tp / wbytes  # tokens/s if every rank streamed its weights at copy speed
        report["tp"][tp] = {"decode_tok_s": b1["decode_tok_s"], "ttft_ms": b1["ttft_ms"],
                            "roofline_tok_s": roof,
                            "of_roofline": b1["decode_tok_s"] / roof if b1["decode_tok_s"]
                            else None, "startup_s": res["startup_s"]}
        print(f"TP={tp}: {b1['decode_tok_s']:.1f} tok/s batch-1 decode "
              f"({report['tp'][tp]['of_roofline']:.2f} of the weights-only roofline)",
              flush=True)
    base = report["tp"][tps[0]]["decode_tok_s"]
    for tp in tps:
        r = report["tp"][tp]
        r["speedup"] = r["decode_tok_s"] / base
        r["efficiency"] = r["speedup"] / (tp / tps[0])
    for dp in dps:
        res = bench_engine(model_dir, a, offline=True, engine_flags={"dp_size": dp})
        off = res["offline"]
        report["dp"][dp] = {"output_tok_s": off["output_tok_s"], "wall_s": off["wall_s"],
                            "requests": off["requests"], "startup_s": res["startup_s"]}
        print(f"DP={dp}: {off['output_tok_s']:.1f} output tok/s offline "
              f"({off['requests']} x {a.input_len}/{a.output_len})", flush=True)
    base = report["dp"][dps[0]]["output_tok_s"]
    for dp in dps:
        r = report["dp"][dp]
        r["speedup"] = r["output_tok_s"] / base
        r["efficiency"] = r["speedup"] / (dp / dps[0])
    print(json.dumps({"tp": report["tp"], "dp": report["dp"]}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
