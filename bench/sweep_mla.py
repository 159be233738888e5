"""Sweep triton_mla's decode tiling and split policy on a CUDA GPU (a diagnostic for
plugins/attention/triton_mla/decode.py's GPU_CONFIG).

    python bench/sweep_mla.py [--out sweep_mla.json] [--quick]

DeepSeek's latent (kv_lora_rank 512 + rope 64), bf16, pages of 16 scattered over the pool, heads
16 (V2-Lite) and 128 (V2/V3), inputs built as bench_mla.py builds them. For every candidate
(block_h, block_n, num_warps, num_stages) x waves x min_split_tokens (the rest of the shipped
GPU_CONFIG kept), the kernels alone (stage 1 + the merge, given q_lat) are first checked against
an fp32 torch reference on a small batch, then timed (L2 flushed before each call, CUDA events:
bench/ceilings.py). Each shape's time is put against bench_mla.py's roofline: the latent bytes
at the copy bandwidth or the score and value FLOPs at the bf16 matmul rate, whichever is longer,
both measured in this run. The tiling that loses least over all shapes
(geometric mean of time over the shape's best) is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
from bench_mla import R  # noqa: E402

SHAPES = [(h, b, c) for h in (16, 128) for b, c in ((1, 512), (1, 4096), (1, 32768), (32, 4096),
                                                    (64, 1024), (64, 32768), (128, 8192))]
# (block_h, block_n, num_warps, num_stages)
TILES = [(16, 32, 4, 2), (16, 16, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (16, 32, 8, 2),
         (16, 64, 8, 2), (32, 32, 8, 2), (32, 16, 8, 2), (32, 32, 8, 3), (32, 64, 8, 2),
         (64, 16, 8, 2), (64, 32, 8, 1)]
WAVES = (1, 2, 4)
MIN_SPLIT = (32, 128)  # min_split_tokens


def make_inputs(h: int, b: int, c: int, page: int, g: torch.Generator,
                device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(q_lat, q_rope, latent buffer, req_to_token, req_pool_indices, seq_lens) of one decode
    step from bench_mla.decode_step (pages scattered over the pool)."""
    from bench_mla import decode_step

    _, w, pool, fb, _, q_nope, q_rope = decode_step(h, b, c, page, dtype, torch.device(device),
                                                     g)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_kc).transpose(0, 1)
    return (q_lat, q_rope, pool.get_latent_buffer(0), fb.req_to_token, fb.req_pool_indices,
            fb.seq_lens)


def reference(q_lat, q_rope, buf, table, rows_of, seq, scaling):
    outs = []
    for i in range(q_lat.shape[0]):
        rows = buf[table[int(rows_of[i]), :int(seq[i])].long()].float()
        s = (q_lat[i].float() @ rows[:, :R].T + q_rope[i].float() @ rows[:, R:].T) * scaling
        outs.append(torch.softmax(s, -1) @ rows[:, :R])
    return torch.stack(outs)


def main(argv: list[str] | None = None) -> int:
    from bench_mla import latent_bytes, roofline_s
    from ceilings import copy_bandwidth, gpu_seconds, matmul_rate

    from plugins.attention.triton_mla.decode import GPU_CONFIG, decode_splits, latent_decode

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="sweep_mla.json")
    ap.add_argument("--quick", action="store_true", help="four tilings, waves 2")
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_mla.py needs a CUDA device", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    copy_bps, mm_fps = copy_bandwidth(dev), matmul_rate(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy {copy_bps / 1e9:.0f} GB/s, bf16 matmul "
          f"{mm_fps / 1e12:.0f} TFLOP/s", flush=True)
    tiles = TILES[:4] if a.quick else TILES
    waves = (2,) if a.quick else WAVES
    scaling = 192 ** -0.5
    g = torch.Generator().manual_seed(0)
    small = make_inputs(128, 2, 3000, 16, g)
    want = reference(*small, scaling)
    results, bad = [], []
    min_splits = (GPU_CONFIG.min_split_tokens,) if a.quick else MIN_SPLIT
    cands = [dataclasses.replace(GPU_CONFIG, block_n=bn, num_warps=nw, num_stages=ns, waves=wv,
                                 min_split_tokens=ms, block_h=bh)
             for bh, bn, nw, ns in tiles for wv in waves for ms in min_splits]
    ok = []
    for cfg in cands:
        try:
            splits = decode_splits(2, 128, dev, 3000, cfg)
            got = latent_decode(*small, kv_lora_rank=R, scaling=scaling, num_splits=splits,
                                config=cfg)
            err = (got.float() - want).abs().max().item()
        except Exception as e:  # a tiling the compiler refuses (shared memory, registers)
            bad.append({"config": repr(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"refused: {cfg}: {type(e).__name__}", flush=True)
            continue
        if not err < 3e-2:
            bad.append({"config": repr(cfg), "error": f"max error {err:.3g} against fp32"})
            print(f"WRONG: {cfg}: max error {err:.3g}", flush=True)
            continue
        ok.append(cfg)
    for h, b, c in SHAPES:
        inputs = make_inputs(h, b, c, 16, g)
        roof = roofline_s(h, b, c, copy_bps, mm_fps)
        for cfg in ok:
            splits = decode_splits(b, h, dev, c, cfg)
            t = gpu_seconds(lambda x=inputs, cfg=cfg, s=splits: latent_decode(
                *x, kv_lora_rank=R, scaling=scaling, num_splits=s, config=cfg), dev, a.reps)
            results.append({"heads": h, "batch": b, "context": c, "block_h": cfg.block_h,
                            "block_n": cfg.block_n, "warps": cfg.num_warps,
                            "stages": cfg.num_stages, "waves": cfg.waves,
                            "min_split": cfg.min_split_tokens, "splits": splits,
                            "us": t * 1e6, "of_roofline": roof / t,
                            "of_copy": latent_bytes(b, c) / t / copy_bps})
        best = max((r for r in results if (r["heads"], r["batch"], r["context"]) == (h, b, c)),
                   key=lambda r: r["of_roofline"])
        print(f"H {h} B {b} ctx {c}: best {best['us']:.1f} us ({best['of_roofline']:.2f} of "
              f"roofline, {best['of_copy']:.2f} of copy) at block_h {best['block_h']} block_n "
              f"{best['block_n']} warps {best['warps']} stages {best['stages']} waves "
              f"{best['waves']} min_split {best['min_split']} splits {best['splits']}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    # the tiling that loses least over every shape
    key = ("block_h", "block_n", "warps", "stages", "waves", "min_split")
    best_of = {}
    for r in results:
        s = (r["heads"], r["batch"], r["context"])
        best_of[s] = min(best_of.get(s, math.inf), r["us"])
    loss: dict[tuple, list[float]] = {}
    for r in results:
        loss.setdefault(tuple(r[k] for k in key), []).append(
            math.log(r["us"] / best_of[(r["heads"], r["batch"], r["context"])]))
    ranked = sorted((math.exp(sum(v) / len(v)), k) for k, v in loss.items()
                    if len(v) == len(SHAPES))
    for geo, k in ranked[:6]:
        print(f"{dict(zip(key, k, strict=True))}: {geo:.3f}x the per-shape best (geomean)")
    Path(a.out).write_text(json.dumps({
        "device": torch.cuda.get_device_name(dev), "copy_GBps": copy_bps / 1e9,
        "matmul_TFLOPs": mm_fps / 1e12, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": results, "refused": bad,
        "ranked": [{"geomean_over_best": geo, **dict(zip(key, k, strict=True))}
                   for geo, k in ranked]}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
