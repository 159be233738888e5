"""MLA decode attention on the CPU: cpu_c_mla against torch_native_mla (the reference), one layer
of DeepSeek-V2-Lite's shape (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128) over a paged
latent pool, beside the memory copy bandwidth measured in the same run.

    python bench/bench_mla_cpu.py [--threads 2] [--dtypes bfloat16 float32] [--reps 7]
                                  [--out mla_cpu.json]

Per (dtype, batch, context): the median wall time of one decode step of one layer (both
backends called with the same batch), against two ceilings measured in the same run:
- bytes: each request's latent rows (576 values a token) plus kv_b_proj's two halves (read once
  for the batch; q and out are noise next to them), at the copy bandwidth (a 256 MiB tensor
  copied, read + written bytes);
- flops: 2 * (576 + 512) a cached row and head (scores and values over the latent; the
  absorption's two small products are left out), at the fp32 matmul rate (torch.mm 2048^3).
With 16 heads sharing each row, absorbed MLA is compute-bound on a CPU: `of roofline` is
max(bytes time, flops time) over the measured time. Requests' pages are scattered over the
pool, as the radix cache leaves them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from core.contract.attention import BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.contract.mla import MLALayerParams, MLAWeights
from core.engine.memory.kv_cache import MLAKVPool

H, R, DR, DN, DV = 16, 512, 64, 128, 128
PAGE = 16


def copy_bandwidth(reps: int) -> float:
    src = torch.ones(2**26)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def matmul_rate(reps: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 ** 3 / best


def decode_batch(pool, backend, batch: int, ctx: int, g) -> ForwardBatch:
    pages = batch * -(-ctx // PAGE)
    order = torch.randperm(pool.num_slots // PAGE - 1, generator=g)[:pages] + 1
    table = torch.zeros(batch, -(-ctx // PAGE) * PAGE, dtype=torch.int32)
    for b in range(batch):
        own = order[b * (pages // batch):(b + 1) * (pages // batch)]
        table[b] = (own[:, None] * PAGE + torch.arange(PAGE)).flatten()
    seq = [ctx] * batch
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(batch, dtype=torch.int64),
        positions=torch.full((batch,), ctx - 1), seq_lens=torch.tensor(seq, dtype=torch.int32),
        prefix_lens=torch.tensor([ctx - 1] * batch, dtype=torch.int32),
        extend_lens=torch.ones(batch, dtype=torch.int32),
        out_cache_loc=table[:, ctx - 1].long(), req_pool_indices=torch.arange(batch),
        req_to_token=table, kv_pool=pool, seq_lens_cpu=seq, prefix_lens_cpu=[ctx - 1] * batch,
        extend_lens_cpu=[1] * batch, attn_backend=backend)
    return fb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from plugins.attention.cpu_c.mla import CpuCMLA, CpuCMLAAvx2, CpuCMLAAvx512
    from plugins.attention.torch_native_mla.backend import TorchNativeMLA
    flags = open("/proc/cpuinfo").read()
    cls = (CpuCMLAAvx512 if "avx512_vnni" in flags else CpuCMLAAvx2 if " avx2" in flags
           else CpuCMLA)
    bw, rate = copy_bandwidth(5), matmul_rate(5)
    layer = MLALayerParams(layer_id=0, num_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN,
                           qk_rope_head_dim=DR, v_head_dim=DV, scaling=(DN + DR) ** -0.5)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s, fp32 matmul {rate / 1e9:.1f} GFLOP/s, "
          f"{a.threads} threads, cpu_c build {cls.variant}")
    print("| dtype | batch | ctx | cpu_c_mla ms | GB/s | GFLOP/s | of roofline | "
          "torch_native_mla ms | of roofline | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.dtypes:
        dtype = getattr(torch, name)
        esz = torch.finfo(dtype).bits // 8
        kv_b = (torch.randn(H * (DN + DV), R, generator=g) / R ** 0.5).to(dtype)
        w = MLAWeights.split(kv_b, H, DN)
        for batch in a.batches:
            for ctx in a.contexts:
                slots = (batch * -(-ctx // PAGE) + 2) * PAGE
                pool = MLAKVPool(slots, 1, R, DR, dtype, "cpu", PAGE)
                pool.latent_buffers[0].copy_(torch.randn(slots, R + DR, generator=g))
                ctxb = BackendContext(num_heads=H, num_kv_heads=1, head_dim=DN + DR,
                                      num_layers=1, dtype=dtype, kv_dtype=dtype,
                                      device=torch.device("cpu"), page_size=PAGE,
                                      max_context_len=ctx)
                q_nope = torch.randn(batch, H, DN, generator=g).to(dtype)
                q_rope = torch.randn(batch, H, DR, generator=g).to(dtype)
                lat = torch.randn(batch, R, generator=g).to(dtype)
                kr = torch.randn(batch, DR, generator=g).to(dtype)
                times, outs = {}, {}
                for label, c in (("c", cls), ("ref", TorchNativeMLA)):
                    backend = c(ctxb)
                    fb = decode_batch(pool, backend, batch, ctx, torch.Generator().manual_seed(1))
                    fb.attn_meta = backend.prepare(fb)
                    outs[label] = backend.forward_mla(q_nope, q_rope, lat, kr, w, layer, fb)
                    ts = []
                    for _ in range(a.reps):
                        t0 = time.perf_counter()
                        backend.forward_mla(q_nope, q_rope, lat, kr, w, layer, fb)
                        ts.append(time.perf_counter() - t0)
                    times[label] = statistics.median(ts)
                err = (outs["c"].float() - outs["ref"].float()).abs().max().item()
                nbytes = batch * ctx * (R + DR) * esz + kv_b.numel() * esz
                flops = 2 * batch * ctx * H * (R + DR + R)
                bound = max(nbytes / bw, flops / rate)
                row = {"dtype": name, "batch": batch, "ctx": ctx, "cpu_c_mla_s": times["c"],
                       "torch_native_mla_s": times["ref"], "bytes": nbytes, "flops": flops,
                       "gb_s": nbytes / times["c"] / 1e9,
                       "gflop_s": flops / times["c"] / 1e9,
                       "of_roofline": bound / times["c"],
                       "ref_of_roofline": bound / times["ref"],
                       "speedup": times["ref"] / times["c"], "max_abs_diff": err}
                rows.append(row)
                print(f"| {name} | {batch} | {ctx} | {times['c'] * 1e3:.3f} | "
                      f"{row['gb_s']:.1f} | {row['gflop_s']:.1f} | {row['of_roofline']:.2f} | "
                      f"{times['ref'] * 1e3:.3f} | {row['ref_of_roofline']:.2f} | "
                      f"{row['speedup']:.1f}x |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"copy_bw_gb_s": bw / 1e9, "matmul_gflop_s": rate / 1e9,
                       "threads": a.threads,
                       "variant": cls.variant, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
