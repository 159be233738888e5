"""cpu_amx's causal extend attention on AMX bf16 tiles (plugins/attention/cpu_c/attn_amx.c)
against what torch_native runs for the same bf16 extend, one layer on the CPU.

    python bench/bench_cpu_amx_attention.py --check          # AMX build vs fp32 reference
    python bench/bench_cpu_amx_attention.py --threads 16 [--reps 5] [--emulated] [--out r.json]

Shapes: SmolLM2 (9 query / 3 KV heads of 64) and a Llama-8B-like layer (32 / 8 of 128); one
request of 512 or 4096 new tokens without prefix, and 512 new tokens over a 3584-token prefix.
The K/V sit in a bf16 pool in shuffled pages of 16 tokens. Per row, median wall times of:
- `amx` (`ours`): the kernel (packs K/V from the pool, then attends);
- `torch_native`: TorchNativeAttention._extend, the backend's own bf16 extend (gathers K/V
  from the pool, then SDPA: causal query blocks of 128 without prefix, one masked SDPA with);
- `sdpa`: F.scaled_dot_product_attention(is_causal / masked) on K/V already dense (no gather);
- `emulated` (--emulated, the smallest shape only): the same source on plain-C tiles.
GFLOP/s count only the unmasked scores, 4 * D flops each (QK^T and PV), per query head; the
speedup is torch_native's time over ours.

--check runs the AMX build on mixed batches (prefixes 0 / 5 / 37 / 100, extends 1 / 17 / 33 /
200, windows, soft-caps, both shapes), on long prompts (1024 with a soft-cap; 4096 for SmolLM2's
shape, 2048 for Llama's) and on 512 tokens over a 3584-token prefix with a window of 1000,
against an fp32 softmax attention of the same bf16 values; exits 1 on a mismatch.
`--check --build emulated` runs the mixed batches on emulated tiles (any CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (str(REPO), str(REPO / "tests")):  # this checkout; the tests' fp32 reference
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_cpu_amx_attention import EXCESS_TOL, MEAN_TOL, errors, reference  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
CASES = (("prompt 512", 0, 512), ("prompt 4096", 0, 4096), ("extend 512 @ 3584", 3584, 512))
PAGE = 16


def make_pool(prefix, new, hkv, d, seed):
    """A bf16 pool holding the requests' tokens in shuffled pages of PAGE; the slot table."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    order = torch.randperm(sum(pages), generator=gen) + 1  # page 0: the padding sink
    slots_n = (sum(pages) + 1) * PAGE
    k_buf = torch.randn(slots_n, hkv, d, generator=gen).bfloat16()
    v_buf = torch.randn(slots_n, hkv, d, generator=gen).bfloat16()
    slots = torch.zeros(len(lens), max(pages) * PAGE, dtype=torch.int64)
    o = 0
    for b, n in enumerate(pages):
        for i in range(n):
            slots[b, i * PAGE:(i + 1) * PAGE] = torch.arange(PAGE) + order[o + i] * PAGE
        o += n
    return k_buf, v_buf, slots, gen


def lens_of(prefix, new):
    starts = [sum(new[:b]) for b in range(len(new))]
    return torch.tensor([list(prefix), list(new), starts], dtype=torch.int64)


def check(lib, threads: int, long: bool) -> int:
    """long: also the long prompts (real tiles; the emulated ones would take minutes)."""
    from plugins.attention.cpu_c.amx import extend_attention

    mixed = ((0, 5, 37, 100), (1, 17, 33, 200))
    runs = []
    for shape, (H, hkv, d) in SHAPES.items():
        cases = [(*mixed, None, None), (*mixed, 24, None), (*mixed, 7, 3.0)]
        if long:  # the reference's scores are H x n x n fp32: 2048 tokens at 32 heads
            cases += [((0,), (1024,), None, 30.0), ((0,), (4096 if H < 16 else 2048,), None, None),
                      ((3584,), (512,), 1000, None)]
        runs += [(shape, H, hkv, d, *c) for c in cases]
    bad = 0
    for shape, H, hkv, d, prefix, new, window, cap in runs:
        k_buf, v_buf, slots, gen = make_pool(prefix, new, hkv, d, seed=len(new) + d)
        q = torch.randn(sum(new), H, d, generator=gen).bfloat16()
        scale = 1 / math.sqrt(d)
        got = extend_attention(lib, q, k_buf, v_buf, slots, lens_of(prefix, new), scale, window,
                               cap, threads).float()
        want = reference(q, k_buf, v_buf, slots, prefix, new, scale, window, cap)
        # bf16 output (2^-8 |out|) and bf16 P: tests/test_cpu_amx_attention.py's bound
        excess, mean = errors(got, want)
        ok = bool(torch.isfinite(got).all()) and excess < EXCESS_TOL and mean < MEAN_TOL
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {shape} prefix {prefix} new {new} window {window} "
              f"cap {cap}: max err {(got - want).abs().max().item():.2e} ({excess:.2e} past "
              f"2^-8 |out|), mean {mean:.2e}", flush=True)
    print("check passed" if not bad else f"check FAILED: {bad} of {len(runs)} mismatch")
    return 1 if bad else 0


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up (first-call allocations, the library's pages)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def causal_flops(prefix: int, new: int, H: int, d: int) -> float:
    """4 D flops per unmasked score: token j (0-based) of the extend sees prefix + j + 1 keys."""
    return 4.0 * d * H * (new * prefix + new * (new + 1) / 2)


def one_case(lib, emu, shape: str, label: str, prefix: int, new: int, threads: int,
             reps: int) -> dict:
    from core.contract.attention import AttentionLayerParams
    from plugins._kit.torch_attention import TorchNativeAttention, TorchNativeMeta
    from plugins.attention.cpu_c.amx import extend_attention

    H, hkv, d = SHAPES[shape]
    k_buf, v_buf, slots, gen = make_pool((prefix,), (new,), hkv, d, seed=1)
    q = torch.randn(new, H, d, generator=gen).bfloat16()
    scale = 1 / math.sqrt(d)
    lens = lens_of((prefix,), (new,))
    layer = AttentionLayerParams(0, H, hkv, d, scale)
    L = prefix + new
    meta = TorchNativeMeta(False, slots, [L], [prefix], [new], [0])
    native = object.__new__(TorchNativeAttention)  # _extend reads only _cpu of its state
    native._cpu = True
    kd = k_buf[slots[0, :L]].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    vd = v_buf[slots[0, :L]].transpose(0, 1).unsqueeze(0)
    qd = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    mask = None if prefix == 0 else \
        torch.arange(L).unsqueeze(0) <= torch.arange(prefix, L).unsqueeze(1)

    def sdpa():
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=prefix == 0,
                                       scale=scale, enable_gqa=H != hkv)

    ms = {"amx": median_ms(lambda: extend_attention(lib, q, k_buf, v_buf, slots, lens, scale,
                                                    threads=threads), reps),
          "torch_native": median_ms(lambda: native._extend(q, k_buf, v_buf, layer, meta), reps),
          "sdpa": median_ms(sdpa, reps)}
    if emu is not None:
        ms["emulated"] = median_ms(lambda: extend_attention(emu, q, k_buf, v_buf, slots, lens,
                                                            scale, threads=threads), 1)
    flops = causal_flops(prefix, new, H, d)
    return {"shape": shape, "heads": H, "kv_heads": hkv, "head_dim": d, "case": label,
            "prefix": prefix, "new": new, "threads": threads,
            "ms": {k: round(v, 3) for k, v in ms.items()},
            "gflops": {k: round(flops / v / 1e6, 1) for k, v in ms.items()},
            # > 1: ours is faster
            "speedup_vs_torch_native": round(ms["torch_native"] / ms["amx"], 3),
            "speedup_vs_sdpa": round(ms["sdpa"] / ms["amx"], 3)}


def bench(lib, emu, threads: int, reps: int, max_tokens: int | None) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for label, prefix, new in CASES:
            if max_tokens and prefix + new > max_tokens:
                continue
            smallest = shape == "smollm2" and (prefix, new) == (0, 512)
            row = one_case(lib, emu if smallest else None, shape, label, prefix, new, threads,
                           reps)
            rows.append(row)
            ms, gf = row["ms"], row["gflops"]
            cells = [f"{ms[k]:.2f} ({gf[k]:.0f})" for k in ("amx", "torch_native", "sdpa")]
            emulated = f"{ms['emulated']:.1f}" if "emulated" in ms else "-"
            print(f"| {shape} | {label} | {' | '.join(cells)} | "
                  f"{row['speedup_vs_torch_native']:.2f} | {emulated} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from plugins.attention.cpu_c.amx import library

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare against the fp32 reference")
    ap.add_argument("--build", choices=("amx", "emulated"), default="amx",
                    help="the kernel build measured / checked (emulated: any CPU, slow)")
    ap.add_argument("--threads", type=int, default=None, help="torch's and the kernel's")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--emulated", action="store_true",
                    help="also time the emulated build at the smallest shape")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="skip cases longer than this (a quick run of the emulated build)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    try:
        lib = library(a.build)
    except RuntimeError as exc:
        print(f"cannot load the {a.build} build of attn_amx.c: {exc}", file=sys.stderr)
        return 2
    print(f"attn_amx.c build {lib.amx_attn_variant().decode()}, bfloat16, {threads} thread(s), "
          f"torch {torch.__version__}")
    if a.check:
        return check(lib, threads, long=a.build == "amx")
    emu = library("emulated") if a.emulated else None
    print(f"ms (GFLOP/s, unmasked scores only); `ours`: the {a.build} build\n"
          "| shape | case | ours | torch_native | sdpa (dense K/V) | speedup vs torch_native | "
          "emulated ms |\n|---|---|---|---|---|---|---|")
    rows = bench(lib, emu, threads, a.reps, a.max_tokens)
    if a.out:
        a.out.write_text(json.dumps({"build": lib.amx_attn_variant().decode(),
                                     "threads": threads, "torch": torch.__version__,
                                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
