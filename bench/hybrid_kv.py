"""Hybrid KV pool vs a pool without windows, for a Gemma-3-shaped model at long context.

Builds the KV pools alone (no weights, no forward): the hybrid pool's groups
(core.engine.memory.kv_groups) and, for the same byte budget, one pool keeping every layer's
K/V. Then places requests of `--context` tokens through the scheduler's page manager
(core.engine.scheduler.pages.Pages: chunked prefill grows, windowed groups trim), one after
another until the next one does not fit, and reports, measured from the pools (bytes of the
buffers allocated, pages the allocators handed out):

- KV bytes per context token held by one request, beside the full-attention layers' share;
- how many requests of that length fit in the budget, hybrid vs without windows.

    python bench/hybrid_kv.py --model gemma-3-27b --budget-gib 100 --device cuda
    python bench/hybrid_kv.py --model gemma-3-4b --budget-gib 16      # CPU: calloc, lazy

The shapes are the public Gemma 3 text configs' (layers, KV heads, head dim, window, every
6th layer global); the windowed pool's share is --ratio (default: the window, two pages and one
prefill chunk per context length, i.e. just what each request of that length needs there).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from core.engine.memory.kv_cache import KVPool
from core.engine.memory.kv_groups import group_tokens, kv_groups, split_budget_bytes_per_token
from core.engine.memory.memory_pool import PageAllocator, ReqToTokenPool
from core.engine.memory.radix_cache import NoPrefixCache
from core.engine.scheduler.pages import Pages

# (layers, KV heads, head dim, window), every 6th layer global (layer_types of the HF configs)
SHAPES = {"gemma-3-1b": (26, 1, 256, 512), "gemma-3-4b": (34, 4, 256, 1024),
          "gemma-3-12b": (48, 8, 256, 1024), "gemma-3-27b": (62, 16, 128, 1024)}


def windows_of(layers: int, window: int) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def pool_bytes(pool: KVPool) -> int:
    return sum(t.numel() * t.element_size() for t in (*pool.k_buffers, *pool.v_buffers)
               if t is not None)


def build(wins, layers, kv_heads, head_dim, dtype, device, budget, ratio, ps, chunk,
          context, max_reqs):
    """(pages manager, pools) for `budget` bytes; wins all None: one pool without windows."""
    groups = kv_groups(wins, layers)
    layer_bytes = KVPool.bytes_per_token(1, kv_heads, head_dim, dtype)
    per_token = split_budget_bytes_per_token(groups, layer_bytes, ratio)
    full = int(budget // per_token) // ps * ps
    tokens = [max(group_tokens(full, ratio, ps),
                  -(-min(full, g.window + chunk + 2 * ps) // ps) * ps) for g in groups[1:]]
    pools = [KVPool(full + ps, layers, kv_heads, head_dim, dtype, device, ps,
                    layers=groups[0].layers)]
    pools += [KVPool(t + 2 * ps, layers, kv_heads, head_dim, dtype, device, ps,
                     layers=g.layers) for g, t in zip(groups[1:], tokens, strict=True)]
    alloc = PageAllocator((full + ps) // ps, ps)
    gallocs = [PageAllocator(n, ps, dummy_page=n) for n in ((t + ps) // ps for t in tokens)]
    table = ReqToTokenPool(max_reqs, context, device, groups=len(groups))
    pages = Pages(alloc, table, NoPrefixCache(alloc, ps, gallocs), ps,
                  [g.window for g in groups[1:]], gallocs)
    return pages, pools, groups


def place(pages: Pages, context: int, chunk: int) -> list:
    """Prefill requests of `context` tokens in chunks until one does not fit; the placed ones."""
    placed = []
    while pages.req_to_token.free_rows:
        req = SimpleNamespace(row=-1, pages=[], wpages=[], wtrimmed=[], num_shared=0, all_ids=[],
                              node=None, kv_len=0, lora_id=None, lora_slot=-1)
        pages.take(req, [], None)
        while req.kv_len < context:
            n = min(chunk, context - req.kv_len)
            if not pages.grow(req, n):
                pages.release(req)  # does not fit: gives back what it got
                return placed
            req.kv_len += n
            pages.trim(req)
        placed.append(req)
    return placed


def held_bytes(pages: Pages, pools: list[KVPool]) -> int:
    """Bytes of the pages the allocators have handed out (measured: used pages x page bytes)."""
    total = 0
    for alloc, pool in zip(pages.allocators, pools, strict=True):
        page_bytes = pool_bytes(pool) // pool.num_slots * pool.page_size
        total += (alloc.total_pages - alloc.free_pages) * page_bytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="gemma-3-4b")
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    ap.add_argument("--ratio", type=float, default=None, help="--swa-full-tokens-ratio")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-reqs", type=int, default=64)
    a = ap.parse_args()
    layers, kv_heads, head_dim, window = SHAPES[a.model]
    dtype, ps, ctx = torch.bfloat16, a.page_size, a.context
    budget = int(a.budget_gib * 2**30)
    ratio = a.ratio if a.ratio is not None else min(1.0, (window + a.chunk + 2 * ps) / ctx)
    wins = windows_of(layers, window)
    n_full = sum(w is None for w in wins)
    layer_bytes = KVPool.bytes_per_token(1, kv_heads, head_dim, dtype)
    print(f"{a.model}-shaped: {layers} layers ({n_full} global, window {window}), {kv_heads} KV "
          f"heads x {head_dim}, bf16; budget {a.budget_gib} GiB; context {ctx}; page {ps}; "
          f"prefill chunk {a.chunk}; ratio {ratio:.4f}; device {a.device}")
    print(f"global layers' share: {n_full * layer_bytes} B/token; all layers: "
          f"{layers * layer_bytes} B/token")
    rows = []
    for name, w in (("hybrid", wins), ("no windows", [None] * layers)):
        t = time.perf_counter()
        pages, pools, groups = build(w, layers, kv_heads, head_dim, dtype, a.device, budget,
                                     ratio, ps, a.chunk, ctx, a.max_reqs)
        allocated = sum(pool_bytes(p) for p in pools)
        placed = place(pages, ctx, a.chunk)
        one = None
        if placed:  # one request alone: release the others' pages
            for r in placed[1:]:
                pages.release(r)
            one = held_bytes(pages, pools) / ctx
            pages.release(placed[0])
        caps = ", ".join(f"{g.describe()}: {(al.total_pages) * ps} tokens"
                         for g, al in zip(groups, pages.allocators, strict=True))
        rows.append((name, allocated, one, len(placed)))
        print(f"{name:>10}: pools {allocated / 2**30:.2f} GiB ({caps}); "
              f"{len(placed)} requests of {ctx} fit; one request holds "
              + (f"{one:.0f} B/token ({one / (n_full * layer_bytes):.3f}x the global share)"
                 if one is not None else "- (none fits)")
              + f"  [{time.perf_counter() - t:.1f} s]")
    (_, _, _, nh), (_, _, _, nb) = rows
    print(f"requests of {ctx} tokens that fit in {a.budget_gib} GiB: hybrid {nh}, "
          f"without windows {nb}")


if __name__ == "__main__":
    main()
