"""Sweep the Triton attention kernels' tilings on a CUDA GPU; print the best per shape and the
tuning-table entries (plugins/attention/triton/tuning.py) they imply.

    python bench/sweep_triton.py                      # writes sweep_triton.json, ~2-4 minutes
    python bench/sweep_triton.py --out x.json --quick # fewer candidates
    python bench/sweep_triton.py --shape gemma2 --skip extend   # head dim 256 (the d256 entries)

Shapes are bench_attention.py's (32 query heads, 8 KV heads, head dim 128, bf16, pages of 16
scattered over the pool; `--shape gemma2`: Gemma 2's 16 query heads, 8 KV heads, head dim
256): decode B in 1/32/64/256 x context 512/4k/32k, extend (one request) prefix 0/4k/8k x new
128/4k. Per shape it times, with the L2 flushed before every call and CUDA
events (ceilings.gpu_seconds):

- the kernels alone for each candidate tiling (decode: block_n, warps, stages, and every split
  count from 1 to 64 that leaves >= 64 tokens per split; extend: block_m, block_n, warps, stages);
- the backend as bench_attention times it (KV write + kernels, the shipped defaults), and
  torch_native (the issue-5 peer);
- for decode, the shipped default also replayed from a CUDA graph (GPU time without host launch
  gaps) and its host launch time, to tell a slow kernel from a host-bound one.

Ratios are to the copy bandwidth (decode) and the bf16 matmul rate (extend) measured in the same
run (bench/ceilings.py). The decode split policy (waves, min_split_tokens) and tile that lose the
least over every decode shape, and the extend tilings ranked over the long (new=4096) shapes, are
printed as tuning.py entries at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

SHAPES = {"llama": (32, 8, 128), "gemma2": (16, 8, 256)}  # query heads, KV heads, head dim
DECODE_SHAPES = [(b, c) for b in (1, 32, 64, 256) for c in (512, 4096, 32768)]
EXTEND_SHAPES = [(p, n) for p in (0, 4096, 8192) for n in (128, 4096)]
# (block_n, num_warps, num_stages)
DECODE_TILES = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2),
                (128, 8, 3), (64, 4, 1), (128, 4, 1)]
# (block_m, block_n, num_warps, num_stages[, pack_gqa[, maxnreg]]); packed: block_m rows =
# block_m / 4 positions x the 4 query heads of a KV head (GQA 32/8)
EXTEND_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                (256, 64, 16, 2), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2),
                (128, 32, 8, 4), (256, 64, 16, 2, True), (256, 64, 16, 3, True),
                (256, 128, 16, 2, True), (128, 64, 8, 3, True), (128, 128, 8, 2, True),
                (128, 64, 4, 3, True), (64, 128, 4, 2, True),
                (256, 64, 16, 4, True), (256, 32, 16, 3, True), (256, 32, 16, 4, True),
                (256, 64, 8, 3, True), (256, 128, 16, 3, True),
                # maxnreg 128 (8 warps) / 168 (4 warps): two or three programs per SM
                (128, 64, 8, 3, True, 128), (128, 64, 8, 2, True, 128), (128, 64, 8, 4, True, 128),
                (128, 32, 8, 3, True, 128), (128, 32, 8, 4, True, 128), (128, 64, 8, 3, False, 128),
                (128, 64, 8, 2, False, 128), (64, 64, 4, 3, True, 168), (64, 64, 4, 3, True, 128),
                (64, 128, 4, 2, True, 168), (64, 32, 4, 3, True, 128)]
QUICK_DECODE_TILES = DECODE_TILES[:4]
QUICK_EXTEND_TILES = EXTEND_TILES[:5]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
POLICY_WAVES = (1, 2, 4, 8, 16)
POLICY_MIN_SPLIT = (128, 256, 512, 1024)
REPS = 10


def _log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("inf")


def _timed(fn, device, gpu_seconds) -> float | str:
    """Median GPU seconds of fn, or the reason it could not run (e.g. out of resources)."""
    try:
        return gpu_seconds(fn, device, reps=REPS)
    except Exception as exc:  # noqa: BLE001 - a tiling over the shared-memory limit, OOM
        torch.cuda.synchronize(device)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _graph_seconds(fn, device, gpu_seconds) -> float | str:
    """GPU seconds of fn replayed from a CUDA graph (no host launch gaps in the timing)."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
        return gpu_seconds(graph.replay, device, reps=REPS)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _host_us(fn, device, n: int = 20) -> float:
    """Host time to launch one call (no sync inside), in microseconds."""
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize(device)
    return host * 1e6


def _backend_fn(name, step):
    """bench_attention's timed call: prepare once, then forward (KV write + attention)."""
    from core.plan.registry import get_registry

    backend = get_registry().get("attention", name).load()(step.ctx)
    batch = step.batch
    batch.attn_backend, batch.attn_meta = backend, backend.prepare(batch)
    return lambda: backend.forward(step.q, step.k, step.v, step.layer, batch)


def sweep_decode(ba, device, ceil, gpu_seconds, tiles, t0) -> list[dict]:
    from plugins.attention.triton.common import DecodeConfig
    from plugins.attention.triton.decode import decode_attention, decode_splits

    rows = []
    for B, ctx in DECODE_SHAPES:
        step = ba._step("decode", B, ctx - 1, 1, device)
        b = step.batch
        k_buf, v_buf = b.kv_pool.get_kv_buffer(0)
        q = step.q.view(B, ba.H, ba.D)
        nbytes = ba._decode_bytes(B, ctx)

        def kernel(cfg, splits, q=q, k_buf=k_buf, v_buf=v_buf, b=b, step=step):
            return lambda: decode_attention(q, k_buf, v_buf, b.req_to_token,
                                            b.req_pool_indices, b.seq_lens,
                                            scaling=step.layer.scaling, num_splits=splits,
                                            config=cfg)

        cands = []
        for tile in tiles:
            for s in SPLITS:
                if s > 1 and ctx // s < 64:
                    continue
                # min_split_tokens 1: the kernel uses exactly `s` splits.
                cfg = DecodeConfig(*tile, min_split_tokens=1)
                sec = _timed(kernel(cfg, s), device, gpu_seconds)
                cands.append(dict(tile=list(tile), splits=s, **_rate(sec, nbytes, ceil, "d")))
        ok = [c for c in cands if "ms" in c]
        best = min(ok, key=lambda c: c["ms"]) if ok else None
        default_splits = decode_splits(B, ba.H, ba.HKV, ba.D, ba.D, ba.DTYPE, device,
                                       context=ctx)
        dflt = kernel(None, default_splits)
        row = dict(batch=B, context=ctx, bytes=nbytes, candidates=cands, best=best,
                   default_splits=default_splits,
                   default_kernel=_rate(_timed(dflt, device, gpu_seconds), nbytes, ceil, "d"),
                   default_graph=_rate(_graph_seconds(dflt, device, gpu_seconds), nbytes, ceil,
                                       "d"),
                   default_host_us=round(_host_us(dflt, device), 1),
                   triton_backend=_rate(_timed(_backend_fn("triton", step), device,
                                               gpu_seconds), nbytes, ceil, "d"))
        if B >= 32 and ctx >= 4096:
            row["torch_native"] = _rate(_timed(_backend_fn("torch_native", step), device,
                                               gpu_seconds), nbytes, ceil, "d")
        rows.append(row)
        _log(t0, f"decode B={B} ctx={ctx}: best {_brief(best)}; shipped backend "
                 f"{_brief(row['triton_backend'])}")
    ba._STEPS.clear()
    torch.cuda.empty_cache()
    return rows


def sweep_extend(ba, device, ceil, gpu_seconds, tiles, t0) -> list[dict]:
    from plugins.attention.triton.common import ExtendConfig
    from plugins.attention.triton.extend import extend_attention

    rows = []
    for prefix, new in EXTEND_SHAPES:
        step = ba._step("extend", 1, prefix, new, device)
        b = step.batch
        k_buf, v_buf = b.kv_pool.get_kv_buffer(0)
        q = step.q.view(-1, ba.H, ba.D)
        starts = torch.zeros(1, dtype=torch.int32, device=device)
        flops = ba._extend_flops(1, prefix, new)

        def kernel(cfg, q=q, k_buf=k_buf, v_buf=v_buf, b=b, step=step, starts=starts, new=new):
            return lambda: extend_attention(q, k_buf, v_buf, b.req_to_token,
                                            b.req_pool_indices, b.seq_lens, b.extend_lens,
                                            starts, new, scaling=step.layer.scaling, config=cfg)

        cands = [dict(tile=list(t), **_rate(_timed(kernel(ExtendConfig(*t)), device,
                                                   gpu_seconds), flops, ceil, "e"))
                 for t in tiles]
        ok = [c for c in cands if "ms" in c]
        best = min(ok, key=lambda c: c["ms"]) if ok else None
        row = dict(prefix=prefix, new=new, flops=flops, candidates=cands, best=best,
                   triton_backend=_rate(_timed(_backend_fn("triton", step), device,
                                               gpu_seconds), flops, ceil, "e"),
                   torch_native=_rate(_timed(_backend_fn("torch_native", step), device,
                                             gpu_seconds), flops, ceil, "e"))
        rows.append(row)
        _log(t0, f"extend prefix={prefix} new={new}: best {_brief(best)}; shipped backend "
                 f"{_brief(row['triton_backend'])}; torch_native {_brief(row['torch_native'])}")
    ba._STEPS.clear()
    torch.cuda.empty_cache()
    return rows


def _rate(sec, work: float, ceil, phase: str) -> dict:
    if isinstance(sec, str):
        return {"error": sec}
    if phase == "d":
        rate = work / sec
        return dict(ms=round(sec * 1e3, 4), GBps=round(rate / 1e9, 1),
                    ratio=round(rate / ceil.copy_bytes_per_s, 3))
    rate = work / sec
    return dict(ms=round(sec * 1e3, 4), TFLOPs=round(rate / 1e12, 1),
                ratio=round(rate / ceil.matmul_flop_per_s, 3))


def _brief(r: dict | None) -> str:
    if not r:
        return "-"
    if "error" in r:
        return r["error"]
    what = " ".join(f"{k}={r[k]}" for k in ("tile", "splits") if k in r)
    return f"{what} {r['ms']:.3f} ms ({r['ratio']:.2f})".strip()


def decode_policy(rows: list[dict], device: torch.device, kv_heads: int,
                  head_blocks: int) -> dict:
    """The (tile, waves, min_split_tokens) whose heuristic split counts lose the least, as the
    geometric mean over every decode shape of time / best time of that shape."""
    from plugins.attention.triton.common import DecodeConfig, num_kv_splits

    results = []
    tiles = sorted({tuple(c["tile"]) for r in rows for c in r["candidates"]})
    for tile in tiles:
        for waves in POLICY_WAVES:
            for min_split in POLICY_MIN_SPLIT:
                cfg = DecodeConfig(*tile, waves=waves, min_split_tokens=min_split)
                losses = []
                for r in rows:
                    times = {c["splits"]: c["ms"] for c in r["candidates"]
                             if tuple(c["tile"]) == tile and "ms" in c}
                    if not times or not r["best"]:
                        continue
                    s = num_kv_splits(r["batch"], kv_heads, head_blocks, device, cfg,
                                      r["context"])
                    # The kernel runs min(s, ceil(context / min_split)) splits.
                    s = min(s, -(-r["context"] // min_split))
                    s = max((k for k in times if k <= s), default=min(times))
                    losses.append(times[s] / r["best"]["ms"])
                if losses:
                    results.append(dict(tile=list(tile), waves=waves, min_split=min_split,
                                        gmean_loss=round(_gmean(losses), 4),
                                        worst_loss=round(max(losses), 3)))
    results.sort(key=lambda x: x["gmean_loss"])
    return dict(best=results[0] if results else None, top=results[:8])


def extend_ranking(rows: list[dict]) -> list[dict]:
    """Tiles ranked by geometric-mean time / best over the long (new=4096) extend shapes."""
    long_rows = [r for r in rows if r["new"] >= 4096 and r["best"]]
    out = []
    for tile in sorted({tuple(c["tile"]) for r in rows for c in r["candidates"]}):
        losses = []
        for r in long_rows:
            c = next(c for c in r["candidates"] if tuple(c["tile"]) == tile)
            if "ms" not in c:
                losses = []
                break
            losses.append(c["ms"] / r["best"]["ms"])
        if losses:
            out.append(dict(tile=list(tile), gmean_loss=round(_gmean(losses), 4)))
    return sorted(out, key=lambda x: x["gmean_loss"])


def report(res: dict) -> str:
    c = res["ceilings"]
    lines = [f"Triton sweep on {c['device']}: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul "
             f"{c['matmul_TFLOPs']:.0f} TFLOP/s (this run); torch {res['torch']}, triton "
             f"{res['triton']}", "",
             "| decode shape | best tile (bn,w,s) x splits | best ms | ratio | default splits | "
             "default kernel ms | graph ms | host us | backend ms | backend ratio | "
             "torch_native ms | speedup |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        bst, be, tn = r["best"] or {}, r["triton_backend"], r.get("torch_native", {})
        sp = (f"{tn['ms'] / be['ms']:.2f}x" if "ms" in tn and "ms" in be else "-")
        lines.append(
            f"| B={r['batch']} ctx={r['context']} | {bst.get('tile')} x {bst.get('splits')} | "
            f"{bst.get('ms', '-')} | {bst.get('ratio', '-')} | {r['default_splits']} | "
            f"{r['default_kernel'].get('ms', '-')} | {r['default_graph'].get('ms', '-')} | "
            f"{r['default_host_us']} | {be.get('ms', '-')} | {be.get('ratio', '-')} | "
            f"{tn.get('ms', '-')} | {sp} |")
    lines += ["", "| extend shape | best tile (bm,bn,w,s) | best ms | ratio | backend ms | "
              "backend ratio | torch_native ms | speedup (backend) | speedup (best) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in res["extend"]:
        bst, be, tn = r["best"] or {}, r["triton_backend"], r["torch_native"]
        sp = f"{tn['ms'] / be['ms']:.2f}x" if "ms" in tn and "ms" in be else "-"
        spb = f"{tn['ms'] / bst['ms']:.2f}x" if "ms" in tn and "ms" in bst else "-"
        lines.append(f"| prefix={r['prefix']} new={r['new']} | {bst.get('tile')} | "
                     f"{bst.get('ms', '-')} | {bst.get('ratio', '-')} | {be.get('ms', '-')} | "
                     f"{be.get('ratio', '-')} | {tn.get('ms', '-')} | {sp} | {spb} |")
    pol = res.get("decode_policy", {}).get("best")
    lines += ["", "Issue-5 targets: decode B>=32 ctx>=4k >= 0.75 of copy; extend prefix=4096 "
              "new=4096 >= 0.40 of matmul and >= 2x torch_native (see the tables above)."]
    if pol:
        lines += ["", "Suggested tuning.py entries (arch/width of this GPU):",
                  f"DECODE[({res['arch']!r}, {res['width']!r})] = ({pol['tile'][0]}, "
                  f"{pol['tile'][1]}, "
                  f"{pol['tile'][2]}, {pol['waves']}, {pol['min_split']})"
                  f"  # gmean loss {pol['gmean_loss']}, worst {pol['worst_loss']}"]
    rank = res.get("extend_ranking") or []
    if rank:
        tiles = ", ".join(f"({', '.join(map(str, t['tile']))})" for t in rank[:4])
        lines.append(f"EXTEND[({res['arch']!r}, {res['width']!r})] = ({tiles})  # gmean loss "
                     + ", ".join(str(t["gmean_loss"]) for t in rank[:4]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sweep_triton.json")
    ap.add_argument("--quick", action="store_true", help="fewer candidate tilings")
    ap.add_argument("--skip", choices=("decode", "extend"), action="append", default=[])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama",
                    help="query heads, KV heads, head dim: llama 32/8/128, gemma2 16/8/256")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the sweep times compiled kernels on a GPU")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the sweep runs on a GPU")
    import bench_attention as ba
    import triton
    from ceilings import gpu_seconds, measure

    from plugins.attention.triton.common import arch_key, sm_count, width_key
    from plugins.attention.triton.decode import _head_blocking

    ba.H, ba.HKV, ba.D = SHAPES[args.shape]  # bench_attention reads them when it builds a step
    t0 = time.perf_counter()
    device = torch.device("cuda")
    ceil = measure(device, ba.DTYPE)
    _log(t0, f"ceilings: copy {ceil.copy_bytes_per_s / 1e9:.0f} GB/s, matmul "
             f"{ceil.matmul_flop_per_s / 1e12:.0f} TFLOP/s")
    res = dict(ceilings=ceil.as_info(), torch=torch.__version__, triton=triton.__version__,
               arch=arch_key(device), width=width_key(ba.D, ba.D, ba.DTYPE),
               shape=dict(zip(("heads", "kv_heads", "head_dim"), SHAPES[args.shape], strict=True)),
               sm_count=sm_count(device), decode=[], extend=[])
    if "decode" not in args.skip:
        tiles = QUICK_DECODE_TILES if args.quick else DECODE_TILES
        res["decode"] = sweep_decode(ba, device, ceil, gpu_seconds, tiles, t0)
        res["decode_policy"] = decode_policy(res["decode"], device, ba.HKV,
                                             _head_blocking(ba.H // ba.HKV)[1])
    if "extend" not in args.skip:
        tiles = QUICK_EXTEND_TILES if args.quick else EXTEND_TILES
        res["extend"] = sweep_extend(ba, device, ceil, gpu_seconds, tiles, t0)
        res["extend_ranking"] = extend_ranking(res["extend"])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print()
    print(report(res))
    print(f"\nwrote {args.out} ({res['wall_s']} s)")


if __name__ == "__main__":
    main()
