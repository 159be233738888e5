"""MLA decode on CUDA: triton_mla's decode step against the device's copy bandwidth, with
torch_native_mla (the reference backend) as the peer in the same run.

    python bench/bench_mla.py [--batch 1,32,64] [--context 4096,32768] [--heads 16,128]
                              [--page 16] [--reps 10] [--no-peer] [--out mla.json|mla.md]

One layer of DeepSeek's MLA head (kv_lora_rank 512, rope 64, nope 128, v 128), bf16, requests'
pages scattered over the latent pool as the radix cache leaves them. Per (heads, batch, context),
GPU times (bench/ceilings.py: L2 flushed before each call, CUDA events, median) of:
- `kernel`: the Triton part alone (stage 1 + the split merge, given q_lat);
- `forward`: triton_mla's whole forward_mla (the latent write, q_nope @ w_kc, the kernels,
  o_lat @ w_vc^T);
- `peer`: torch_native_mla's forward_mla on the same batch (its per-request absorbed loop).
Bytes are the latent rows actually read, B * ctx * 576 * 2 per layer; `of copy` is the achieved
rate over those bytes divided by the copy bandwidth measured in the same run (a 1 GiB
device-to-device copy, read + written bytes: bench/ceilings.py). At 128 heads a latent row feeds
128 x 2 x (576 + 512) FLOPs, so the kernel is near compute-bound there: `of roofline` puts the
kernel time against the longer of the bytes at copy bandwidth and the FLOPs at the bf16 matmul
rate measured in the same run. The copy of a buffer of the
same size as the latent read is reported beside it (`copy same-size GB/s`): small reads do not
reach the big copy's rate either. Without CUDA the script says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # run as a script or imported from a test: `ceilings` by name
    sys.path.insert(0, str(BENCH))

R, DR, DN, DV = 512, 64, 128, 128
WIDTH = R + DR


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_ints, default=[1, 32, 64])
    ap.add_argument("--context", type=_ints, default=[4096, 32768])
    ap.add_argument("--heads", type=_ints, default=[16, 128])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true", help="leave torch_native_mla out")
    ap.add_argument("--out", help="write the results: .json as JSON, anything else markdown")
    return ap.parse_args(argv)


def decode_step(H: int, batch: int, ctx: int, page: int, dtype: torch.dtype,
                device: torch.device, g: torch.Generator):
    """(layer, weights, pool, forward batch, new rows [B, W], q_nope, q_rope) of one decode
    step: every request at `ctx` tokens, its pages shuffled over the pool."""
    from core.contract.forward_batch import ForwardBatch, ForwardMode
    from core.contract.mla import MLALayerParams, MLAWeights
    from core.engine.memory.kv_cache import MLAKVPool

    layer = MLALayerParams(layer_id=0, num_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN,
                           qk_rope_head_dim=DR, v_head_dim=DV, scaling=(DN + DR) ** -0.5)
    kv_b = (torch.randn(H * (DN + DV), R, generator=g) / R ** 0.5).to(device, dtype)
    w = MLAWeights.split(kv_b, H, DN)
    per = -(-ctx // page)
    pool = MLAKVPool((batch * per + 2) * page, 1, R, DR, dtype, device, page)
    pool.latent_buffers[0].normal_()
    order = torch.randperm(batch * per + 1, generator=g)[:batch * per] + 1
    table = (order.view(batch, per)[:, :, None] * page + torch.arange(page)).view(batch, -1)
    table = table.to(device, torch.int32)
    seq = [ctx] * batch
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(batch, dtype=torch.int64, device=device),
        positions=torch.full((batch,), ctx - 1, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor([ctx - 1] * batch, dtype=torch.int32, device=device),
        extend_lens=torch.ones(batch, dtype=torch.int32, device=device),
        out_cache_loc=table[:, ctx - 1].long(), req_pool_indices=torch.arange(batch,
                                                                              device=device),
        req_to_token=table, kv_pool=pool, seq_lens_cpu=seq, prefix_lens_cpu=[ctx - 1] * batch,
        extend_lens_cpu=[1] * batch)
    new = torch.randn(batch, WIDTH, generator=g).to(device, dtype)
    q_nope = torch.randn(batch, H, DN, generator=g).to(device, dtype)
    q_rope = torch.randn(batch, H, DR, generator=g).to(device, dtype)
    return layer, w, pool, fb, new, q_nope, q_rope


def latent_bytes(batch: int, ctx: int) -> int:
    """Latent rows one layer's decode step reads: batch x ctx rows of 576 bf16 values."""
    return batch * ctx * WIDTH * 2


def roofline_s(H: int, batch: int, ctx: int, copy_bps: float, mm_fps: float) -> float:
    """The longer of the latent bytes at copy bandwidth and the FLOPs at the matmul rate
    (scores over the whole row, then p @ c over its R values)."""
    flops = 2 * batch * ctx * H * (WIDTH + R)
    return max(latent_bytes(batch, ctx) / copy_bps, flops / mm_fps)


def measure(H: int, batch: int, ctx: int, a: argparse.Namespace, copy_bps: float,
            mm_fps: float, g: torch.Generator) -> dict:
    """One (heads, batch, context) row: triton_mla's kernel and forward, the same-size copy,
    and the peer."""
    from ceilings import gpu_seconds

    from core.contract.attention import BackendContext
    from plugins.attention.torch_native_mla.backend import TorchNativeMLA
    from plugins.attention.triton_mla.backend import TritonMLA
    from plugins.attention.triton_mla.decode import latent_decode

    device, dtype = torch.device("cuda"), torch.bfloat16
    layer, w, pool, fb, new, q_n, q_r = decode_step(H, batch, ctx, a.page, dtype, device, g)
    bctx = BackendContext(H, 1, DN + DR, 1, dtype, dtype, device, a.page, ctx)
    triton_mla = TritonMLA(bctx)
    fb.attn_meta = meta = triton_mla.prepare(fb)
    buf = pool.get_latent_buffer(0)
    q_lat = torch.bmm(q_n.transpose(0, 1), w.w_kc).transpose(0, 1)

    def kernel():
        latent_decode(q_lat, q_r, buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                      kv_lora_rank=R, scaling=layer.scaling, num_splits=meta.num_splits)

    def forward(backend=triton_mla):
        backend.forward_mla(q_n, q_r, new[:, :R], new[:, R:], w, layer, fb)

    nbytes = latent_bytes(batch, ctx)
    roofline = roofline_s(H, batch, ctx, copy_bps, mm_fps)
    t_kernel = gpu_seconds(kernel, device, a.reps)
    t_forward = gpu_seconds(forward, device, a.reps)
    same = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(same)
    t_copy = gpu_seconds(lambda: dst.copy_(same), device, a.reps)
    row = {"heads": H, "batch": batch, "context": ctx, "splits": meta.num_splits,
           "latent_bytes": nbytes, "kernel_us": t_kernel * 1e6, "forward_us": t_forward * 1e6,
           "kernel_GBps": nbytes / t_kernel / 1e9, "forward_GBps": nbytes / t_forward / 1e9,
           "kernel_of_copy": nbytes / t_kernel / copy_bps,
           "kernel_of_roofline": roofline / t_kernel,
           "forward_of_copy": nbytes / t_forward / copy_bps,
           "copy_same_size_GBps": 2 * nbytes / t_copy / 1e9}
    if not a.no_peer:
        peer = TorchNativeMLA(bctx)
        fb.attn_meta = peer.prepare(fb)
        t_peer = gpu_seconds(lambda: forward(peer), device, max(2, a.reps // 3), warmup=1)
        row |= {"peer_us": t_peer * 1e6, "peer_of_copy": nbytes / t_peer / copy_bps,
                "speedup_vs_peer": t_peer / t_forward}
    return row


def run(a: argparse.Namespace) -> dict:
    from ceilings import copy_bandwidth, matmul_rate

    device = torch.device("cuda")
    copy_bps, mm_fps = copy_bandwidth(device), matmul_rate(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {copy_bps / 1e9:.0f} GB/s "
          f"(1 GiB, read + written), bf16 matmul {mm_fps / 1e12:.0f} TFLOP/s", flush=True)
    print(HEADER, flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for H in a.heads:
        for batch in a.batch:
            for ctx in a.context:
                rows.append(measure(H, batch, ctx, a, copy_bps, mm_fps, g))
                print(_md_row(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), "dtype": "bfloat16",
            "page_size": a.page, "copy_GBps": copy_bps / 1e9,
            "matmul_TFLOPs": mm_fps / 1e12, "command": " ".join(sys.argv),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


HEADER = ("| heads | batch | context | splits | kernel us | GB/s | of copy | of roofline | "
          "forward us | of copy | copy same-size GB/s | torch_native_mla us | of copy | "
          "speedup |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _md_row(r: dict) -> str:
    peer = (f"{r['peer_us']:.0f} | {r['peer_of_copy']:.3f} | {r['speedup_vs_peer']:.1f}x"
            if "peer_us" in r else "- | - | -")
    return (f"| {r['heads']} | {r['batch']} | {r['context']} | {r['splits']} | "
            f"{r['kernel_us']:.1f} | {r['kernel_GBps']:.0f} | {r['kernel_of_copy']:.2f} | "
            f"{r['kernel_of_roofline']:.2f} | "
            f"{r['forward_us']:.1f} | {r['forward_of_copy']:.2f} | "
            f"{r['copy_same_size_GBps']:.0f} | {peer} |")


def markdown(result: dict) -> str:
    head = (f"MLA decode, one layer, {result['dtype']}, page size {result['page_size']}, "
            f"{result['device']}, copy bandwidth {result['copy_GBps']:.0f} GB/s, bf16 matmul "
            f"{result['matmul_TFLOPs']:.0f} TFLOP/s "
            f"(`{result['command']}`, {result['time']})\n\n")
    return head + HEADER + "\n" + "\n".join(_md_row(r) for r in result["rows"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla.py: no CUDA device here (torch.cuda.is_available() is False): the "
              "triton_mla decode bench runs on a GPU only", file=sys.stderr)
        return 1
    result = run(a)
    if a.out:
        text = (json.dumps(result, indent=1) if a.out.endswith(".json")
                else markdown(result))
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
