"""Tile sweep of the W8A8 Triton kernels (plugins/_kit/w8a8_triton.py) at Llama-3.1-8B shapes.

    python bench/sweep_quant.py --out sweep_quant.json
    python bench/sweep_quant.py --only gemv,int4 --out sweep_gemv.json   # batch-1 kernels

Decode (M = 1, 16): `small_m_linear` over BLOCK_N x SPLIT_K x num_stages, fp8 per-channel
(per-token activations) and fp8 block-wise (per-group activations). Prefill (M = 4096):
`scaled_mm` over BLOCK_M x BLOCK_N x num_warps x num_stages, fp8 block-wise and int8 per-row.
Each timing is the median of CUDA-graph replays (bench_quant_gemm.timed); every row also shows
the default config's time, so the table's gain over the defaults is read from one run.

`gemv` (M = 1, fp8 per-channel and block-wise W8A8): the one-row FMA kernel over BLOCK_N x
BLOCK_K x warps x programs per SM against the 16-row tl.dot kernel, and bf16 F.linear; `int4`:
the int4 one-row kernel's tiles against the 16-row dequant-GEMM at M = 1, then the dequant-GEMM
against dequantize-then-cuBLAS from M = 16 to 4096 (DEQUANT_ROWS). These time a rotation over
enough weight copies (>= 256 MB) that every call reads its weight from HBM, not from the 50 MB
L2 (decode streams every layer's weights once a step), and check each config's output against
the fp32 product of the same quantized operands.
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
    from plugins._kit.w8a8_triton import small_m_linear

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
    from plugins._kit.w8a8_triton import scaled_mm

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


def _l2_copies(nbytes: int) -> int:
    """How many copies of `nbytes` of operands a rotation needs to miss L2 (256 MiB of them)."""
    return max(1, -(-(256 << 20) // nbytes))


def _rotating(make, nbytes: int):
    """fn() calling make(i)() over enough copies of the operands to miss L2; the time per call
    is timed(fn) / copies."""
    copies = _l2_copies(nbytes)
    fns = [make(i) for i in range(copies)]

    def fn():
        for f in fns:
            f()
    return fn, copies


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def sweep_gemv(rows: list, copy_gbps: float) -> None:
    from plugins._kit.w8a8_triton import small_m_linear

    channel = [dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, per_sm=ps)
               for bn, bk, nw, ps in ((16, 512, 4, 8), (32, 256, 4, 8), (16, 512, 8, 8),
                                      (16, 1024, 8, 8), (16, 512, 4, 16))]
    block = [dict(kernel="gemv", BLOCK_N=bn, num_warps=nw, per_sm=ps)
             for bn, nw, ps in ((32, 4, 8), (16, 4, 8), (64, 4, 4), (32, 4, 16))]
    for (shape, (n, k)), blocked in itertools.product(
            [s for s in SHAPES.items() if s[0] != "square"], (False, True)):
        act, blk = ("group", (128, 128)) if blocked else ("token", None)
        ops = [_fp8_operands(n, k, 1, blocked) for _ in range(_l2_copies(n * k))]
        x, w, ws = ops[0]
        wd = w.float() * (ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
                          if blocked else ws)
        from conformance.quant_refs import fake_quant_acts
        ref = fake_quant_acts(x.float(), "fp8_group" if blocked else "fp8_token") @ wd.t()
        xb = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in
              range(_l2_copies(2 * n * k))]
        fn, c = _rotating(lambda i, xb=xb, wb=wb: partial(torch.nn.functional.linear, xb, wb[i]), 2 * n * k)
        bf16 = timed(fn, reps=20) / c
        results = {}
        for cfg in [None, {"kernel": "dot"}] + (block if blocked else channel):
            key = json.dumps(cfg)
            try:
                err = _rel(small_m_linear(x, w, ws, None, act, blk, config=cfg), ref)
                fn, c = _rotating(lambda i, cfg=cfg, ops=ops, act=act, blk=blk: partial(
                    small_m_linear, *ops[i], None, act, blk, config=cfg), n * k)
                t = timed(fn, reps=20) / c
            except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run
                print(f"  {shape} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            results[key] = (t, err)
        best = min(results.items(), key=lambda kv: kv[1][0])
        row = {"kind": "gemv", "format": "fp8_block" if blocked else "fp8_channel",
               "shape": shape, "N": n, "K": k, "M": 1, "bf16_us": bf16 * 1e6,
               "default_us": results.get("null", (float("nan"),))[0] * 1e6,
               "dot_us": results.get(json.dumps({"kernel": "dot"}), (float("nan"),))[0] * 1e6,
               "best_us": best[1][0] * 1e6, "best": json.loads(best[0]),
               "best_weight_GBps": n * k / best[1][0] / 1e9,
               "best_of_copy": n * k / best[1][0] / 1e9 / copy_gbps,
               "best_x_bf16": bf16 / best[1][0], "max_rel_err": max(e for _, e in results.values()),
               "all": {kk: [v[0] * 1e6, v[1]] for kk, v in results.items()}}
        rows.append(row)
        print(json.dumps({kk: vv for kk, vv in row.items() if kk != "all"}), flush=True)


def _int4_operands(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int4 weights in our layout, group 128: (w_q [K/8, N] words, fp16 scales, uint8
    zeros [K/128, N])."""
    from plugins.quant.int4.packing import pack_rows

    w_q = pack_rows(torch.randint(0, 16, (k, n), device="cuda"))
    s = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half()
    z = torch.randint(0, 16, (k // 128, n), device="cuda").to(torch.uint8)
    return w_q, s, z


def sweep_int4(rows: list, copy_gbps: float) -> None:
    from plugins.quant.int4 import gemm
    from plugins.quant.int4.packing import dequantize

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, per_sm=ps)
               for bn, bk, nw, ps in ((256, 128, 2, 4), (256, 128, 2, 8), (128, 128, 1, 8),
                                      (512, 128, 4, 4), (256, 64, 2, 8))]

    for shape, (n, k) in [s for s in SHAPES.items() if s[0] != "square"]:
        copies = _l2_copies(n * k // 2)
        ops = [_int4_operands(n, k) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ dequantize(*ops[0], 128, torch.float32)
        results = {}
        for cfg in [None, "dot"] + configs:
            key = json.dumps(cfg)
            if cfg == "dot":
                def call(i, x=x, ops=ops):
                    return partial(gemm.int4_linear, x, *ops[i], 128, None, sms)
            else:
                def call(i, cfg=cfg, x=x, ops=ops):
                    return partial(gemm.int4_gemv, x, *ops[i], 128, None, sms, cfg)
            try:
                err = _rel(call(0)(), ref)
                fn, c = _rotating(call, n * k // 2)
                t = timed(fn, reps=20) / c
            except Exception as exc:  # noqa: BLE001
                print(f"  int4 {shape} {cfg}: {type(exc).__name__}: {str(exc)[:200]}",
                      flush=True)
                continue
            results[key] = (t, err)
        xb = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in
              range(_l2_copies(2 * n * k))]
        fn, c = _rotating(lambda i, xb=xb, wb=wb: partial(torch.nn.functional.linear, xb, wb[i]), 2 * n * k)
        bf16 = timed(fn, reps=20) / c
        best = min(results.items(), key=lambda kv: kv[1][0])
        row = {"kind": "int4_gemv", "shape": shape, "N": n, "K": k, "M": 1,
               "bf16_us": bf16 * 1e6, "default_us": results["null"][0] * 1e6,
               "dot_us": results['"dot"'][0] * 1e6, "best_us": best[1][0] * 1e6,
               "best": json.loads(best[0]), "default_x_bf16": bf16 / results["null"][0],
               "best_x_bf16": bf16 / best[1][0],
               "best_weight_GBps": n * k / 2 / best[1][0] / 1e9,
               "best_of_copy": n * k / 2 / best[1][0] / 1e9 / copy_gbps,
               "max_rel_err": max(e for _, e in results.values()),
               "all": {kk: [v[0] * 1e6, v[1]] for kk, v in results.items()}}
        rows.append(row)
        print(json.dumps({kk: vv for kk, vv in row.items() if kk != "all"}), flush=True)
        # the crossover: dequant-GEMM vs dequantize + cuBLAS, against bf16
        w_q, s, z = ops[0]
        wb0 = wb[0]
        for m in (16, 64, 256, 4096):
            xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = xm.float() @ dequantize(w_q, s, z, 128, torch.float32)
            t_dot = timed(partial(gemm.int4_linear, xm, w_q, s, z, 128, None, sms), reps=10)
            e_dot = _rel(gemm.int4_linear(xm, w_q, s, z, 128, None, sms), ref)
            t_dq = timed(partial(gemm.int4_dequant_linear, xm, w_q, s, z, 128, None), reps=10)
            e_dq = _rel(gemm.int4_dequant_linear(xm, w_q, s, z, 128, None), ref)
            t_bf = timed(partial(torch.nn.functional.linear, xm, wb0), reps=10)
            row = {"kind": "int4_rows", "shape": shape, "N": n, "K": k, "M": m,
                   "bf16_us": t_bf * 1e6, "dot_us": t_dot * 1e6, "dequant_cublas_us": t_dq * 1e6,
                   "dot_x_bf16": t_bf / t_dot, "dequant_x_bf16": t_bf / t_dq,
                   "err_dot": e_dot, "err_dequant": e_dq}
            rows.append(row)
            print(json.dumps(row), flush=True)
        t_only = timed(partial(gemm.int4_dequant, w_q, s, z, 128, torch.bfloat16), reps=10)
        rows.append({"kind": "int4_dequant_only", "shape": shape, "us": t_only * 1e6,
                     "GBps": (n * k * 2.5) / t_only / 1e9})
        print(json.dumps(rows[-1]), flush=True)


def tinygemm_pack(w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 layout (w_q [K/8, N] words, scales / integer zeros [K/group, N]) -> PyTorch's
    tinygemm operands (torch._weight_int4pack_mm): the weight repacked by
    _convert_weight_to_int4pack from [N, K/2] bytes (the even input in the high nibble), and
    [K/group, N, 2] bf16 (scale, zero) with w = (q - 8) * scale + zero, so zero = (8 - z) * s."""
    from plugins.quant.int4.packing import unpack_rows

    q = unpack_rows(w_q).t().contiguous().to(torch.int32)           # [N, K] nibbles
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    w4 = torch._convert_weight_to_int4pack(packed, inner_k_tiles)
    s = scales.float()
    sz = torch.stack([s, (8.0 - zeros.float()) * s], -1).to(torch.bfloat16).contiguous()
    return w4, sz


def sweep_peers(rows: list, copy_gbps: float) -> None:
    """M = 1 (and 4, 8, 16): the library kernels a batch-1 method could call instead of ours, beside
    ours and bf16, HBM-cold. fp8 per channel: quantize_acts + torch._scaled_mm (cuBLASLt,
    row-wise scales), and the 16-row dot kernel at wider K tiles / more warps; int4: tinygemm
    (torch._weight_int4pack_mm, what gpt-fast's 1.88x used) against int4_gemv, with and without
    its in-place unpack. fp8_prequant_*: the small-M kernel with x quantized by a launch of its
    own or in its prologue."""
    from conformance.quant_refs import fake_quant_acts
    from plugins._kit.w8a8_triton import quantize_acts, small_m_linear
    from plugins.quant.int4 import gemm
    from plugins.quant.int4.packing import dequantize

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dots = [dict(kernel="dot", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=nw, num_stages=st)
            for bn, bk, sk, nw, st in ((64, 256, 2, 4, 3), (64, 256, 4, 4, 4), (32, 512, 2, 4, 3),
                                       (64, 512, 2, 8, 3), (128, 256, 2, 8, 3),
                                       (32, 256, 4, 4, 5))]
    for shape, (n, k) in [s for s in SHAPES.items() if s[0] != "square"]:
        for m in (1, 4, 8, 16):
            res: dict[str, list] = {}

            def record(name, make, nbytes, ref=None, _res=res):
                try:
                    err = _rel(make(0)(), ref) if ref is not None else None
                    fn, c = _rotating(make, nbytes)
                    _res[name] = [timed(fn, reps=20) / c * 1e6, err]
                except Exception as exc:  # noqa: BLE001 - a kernel this torch lacks
                    _res[name] = [None, f"{type(exc).__name__}: {str(exc)[:160]}"]

            copies = _l2_copies(n * k)
            xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                  for _ in range(_l2_copies(2 * n * k))]
            record("bf16", lambda i, xb=xb, wb=wb: partial(torch.nn.functional.linear, xb, wb[i]),
                   2 * n * k)
            ops = [_fp8_operands(n, k, m, False) for _ in range(copies)]
            x, w, ws = ops[0]
            ref = fake_quant_acts(x.float(), "fp8_token") @ (w.float() * ws).t()
            record("fp8_ours", lambda i, ops=ops: partial(small_m_linear, *ops[i], None, "token"),
                   n * k, ref)
            for pre in (False, True):
                record(f"fp8_prequant_{pre}", lambda i, ops=ops, pre=pre: partial(
                    small_m_linear, *ops[i], None, "token", config={"prequant": pre}), n * k, ref)
            for cfg in dots:
                record(f"fp8_dot {json.dumps(cfg)}", lambda i, cfg=cfg, ops=ops: partial(
                    small_m_linear, *ops[i], None, "token", config=cfg), n * k, ref)

            def scaled(i, ops=ops):
                xi, wi, wsi = ops[i]
                wt, st = wi.t(), wsi.t().contiguous()   # [K, N] column-major view, [1, N]

                def go():
                    q, sx = quantize_acts(xi, torch.float8_e4m3fn)
                    return torch._scaled_mm(q, wt, scale_a=sx, scale_b=st,
                                            out_dtype=torch.bfloat16)
                return go
            record("fp8_scaled_mm", scaled, n * k, ref)
            iops = [_int4_operands(n, k) for _ in range(_l2_copies(n * k // 2))]
            ref = xb.float() @ dequantize(*iops[0], 128, torch.float32)
            if m == 1:
                record("int4_ours", lambda i, xb=xb, iops=iops: partial(
                    gemm.int4_gemv, xb, *iops[i], 128, None, sms), n * k // 2, ref)
                # the default (in-place unpack, 4 warps) against the shifted unpack and 2 warps
                for cfg in ({"IN_PLACE": False}, {"IN_PLACE": False, "num_warps": 2},
                            {"num_warps": 2}):
                    record(f"int4_gemv {json.dumps(cfg)}", lambda i, xb=xb, iops=iops, cfg=cfg:
                           partial(gemm.int4_gemv, xb, *iops[i], 128, None, sms, cfg),
                           n * k // 2, ref)
            else:
                record("int4_ours", lambda i, xb=xb, iops=iops: partial(
                    gemm.int4_linear, xb, *iops[i], 128, None, sms), n * k // 2, ref)
            for tiles in (8, 4, 2):
                try:
                    packs = [tinygemm_pack(*o, 128, tiles) for o in iops]
                except Exception as exc:  # noqa: BLE001
                    res[f"int4_tinygemm_k{tiles}"] = [None, f"{type(exc).__name__}: {exc}"[:160]]
                    continue
                record(f"int4_tinygemm_k{tiles}", lambda i, packs=packs, xb=xb: partial(
                    torch._weight_int4pack_mm, xb, packs[i][0], 128, packs[i][1]),
                    n * k // 2, ref)
            bf = res["bf16"][0]
            for name, (us, err) in sorted(res.items(), key=lambda kv: kv[1][0] or 1e9):
                wbytes = 2 * n * k if name == "bf16" else (n * k // 2 if "int4" in name
                                                           else n * k)
                row = {"kind": "peers", "shape": shape, "N": n, "K": k, "M": m, "name": name,
                       "us": us, "rel_err": err,
                       "x_bf16": (bf / us) if us and bf else None,
                       "of_copy": (wbytes / (us * 1e-6) / 1e9 / copy_gbps) if us else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None,
                   help="comma-separated subset of decode, prefill, gemv, int4, peers")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    rows: list = []
    only = set(a.only.split(",")) if a.only else {"decode", "prefill", "gemv", "int4", "peers"}
    from bench_quant_gemm import ceilings

    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    try:
        if "peers" in only:
            sweep_peers(rows, ceil["copy_GBps"])
        if "gemv" in only:
            sweep_gemv(rows, ceil["copy_GBps"])
        if "int4" in only:
            sweep_int4(rows, ceil["copy_GBps"])
        if "decode" in only:
            sweep_decode(rows)
        if "prefill" in only:
            sweep_prefill(rows)
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "ceilings": ceil, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
