"""Latency of the collectives a tensor-parallel decode step makes, between N local processes.

    python bench/collective_latency.py                     # gloo, 2 ranks, host tensors
    python bench/collective_latency.py --backend nccl      # one GPU per rank

Per collective: microseconds per call (median of 5 rounds of --calls calls after a warm-up) for
an all-reduce of one token's hidden state ([1, H]) and of a 16-token batch, an all-gather of
[1, V / N] logits, and the scheduler's one-integer broadcast. A decode step makes 2 all-reduces
per layer, 1 for the embedding, 1 all-gather and 1-2 broadcasts (core/engine/distributed.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn, calls: int) -> float:
    for _ in range(max(10, calls // 10)):
        fn()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(rounds)


def _rank(rank: int, a: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(max(1, a.threads))
    dev = torch.device("cpu") if a.backend == "gloo" else torch.device("cuda", rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.ranks)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    h1 = torch.ones(1, a.hidden, device=dev)
    h16 = torch.ones(16, a.hidden, device=dev)
    part = torch.ones(1, a.vocab // a.ranks, device=dev)
    parts = [torch.empty_like(part) for _ in range(a.ranks)]
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    res = {
        f"all_reduce [1, {a.hidden}]": _timed(lambda: (dist.all_reduce(h1), sync()), a.calls),
        f"all_reduce [16, {a.hidden}]": _timed(lambda: (dist.all_reduce(h16), sync()), a.calls),
        f"all_gather [1, {a.vocab // a.ranks}] x {a.ranks}":
            _timed(lambda: (dist.all_gather(parts, part), sync()), a.calls),
        "broadcast int64 [1]": _timed(lambda: (dist.broadcast(n, 0), sync()), a.calls)}
    if rank == 0:
        print(json.dumps({"backend": a.backend, "ranks": a.ranks, "threads": a.threads,
                          "us_per_call": {k: round(v, 1) for k, v in res.items()}}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="gloo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    from core.engine.distributed import free_loopback_port

    mp.spawn(_rank, args=(a, free_loopback_port()), nprocs=a.ranks)


if __name__ == "__main__":
    main()
