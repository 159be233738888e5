"""The `triton` LoRA backend (core.contract.lora): per step a block table of (start, length,
slot), then per projection one shrink launch (x @ A^T, all output slices at once) and one expand
launch (scaled @ B^T added into each slice of y). See kernels.py for the arithmetic.

Decode-sized steps (at most DECODE_TOKENS tokens) and a decode graph's device-only steps (any
bucket size: LoRABatch.device_only) have their tokens grouped by slot on the device: each
token's slot looked up from the batch's seg_indptr / seg_slots_t (searchsorted), the tokens
sorted by it, and blocks of up to BLOCK_M_DECODE sorted tokens of one slot (blocks.py), so a
block reads its adapter's A and B once for all its tokens (one block per token read them once a
token: 64 times at 64 requests, however few adapters). Nothing read from host lists but the
token count, no sync, a table of max_blocks(T, slots) blocks (unused ones return at once), so
a decode graph captures prepare and apply. Longer steps get BLOCK_M_PREFILL-token blocks of each
adapter segment, built on the host from the segment lists (prefill is not captured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from core.contract.lora import BASE_SLOT, LoRABatch, LoRAConfig, LoRAWeights
from plugins.lora.triton.blocks import group_by_slot
from plugins.lora.triton.kernels import expand_kernel, shrink_kernel

DECODE_TOKENS = 64  # steps up to this many tokens: grouped by slot on the device (blocks.py)
# The shrink's K is cut into splits of at least this many (a multiple of its BLOCK_K), at most
# MAX_SPLITS of them: at batch 1 one program per (block, column tile) looped over all of K and
# took ~36 us for 128 KB of A (H100, Llama-8B shapes, session 24's profile).
MIN_SPLIT_K = 256
MAX_SPLITS = 32
# tl.dot's smallest tile: decode batches spread over adapters have a few tokens per slot
# (64 requests over 8 adapters: 8), so larger blocks would mostly be masked rows
BLOCK_M_DECODE = 16
BLOCK_M_PREFILL = 32


@dataclass
class _Meta:
    num_tokens: int
    block_m: int
    start: torch.Tensor  # [blocks] int32: first row of each block
    length: torch.Tensor  # [blocks] int32: its rows (<= block_m; 0: skipped)
    slot: torch.Tensor  # [blocks] int32: its adapter slot (-1: skipped)
    # [T] int32: row -> token (decode: tokens sorted by slot); None: row t is token t (prefill)
    perm: torch.Tensor | None = None
    # shrink outputs by (width, splits): [splits, rows, width] fp32
    xa: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        return self.start.shape[0]


def split_k(K: int, block_k: int) -> tuple[int, int]:
    """(K per split, splits) of the shrink: splits of at least MIN_SPLIT_K, a multiple of
    block_k, at most MAX_SPLITS of them (fixed by K: a decode graph captures the grid)."""
    per = max(MIN_SPLIT_K, triton.cdiv(K, MAX_SPLITS))
    per = triton.cdiv(per, block_k) * block_k
    return per, triton.cdiv(K, per)


class TritonLoRA:
    """prepare: the step's block table; apply: shrink then expand (module doc)."""

    def __init__(self, config: LoRAConfig):
        self.config = config

    def prepare(self, batch: LoRABatch) -> _Meta | None:
        T = batch.num_tokens
        if T == 0:
            return None
        device = batch.seg_indptr.device
        if T <= DECODE_TOKENS or batch.device_only:
            t = torch.arange(T, dtype=torch.int32, device=device)
            # the segment of token t: the first whose end is past t (empty ones never are)
            seg = torch.searchsorted(batch.seg_indptr[1:].contiguous(), t, right=True)
            table = group_by_slot(batch.seg_slots_t.index_select(0, seg), self.config.num_slots,
                                  BLOCK_M_DECODE)
            return _Meta(T, BLOCK_M_DECODE, table.start, table.length, table.slot, table.perm)
        starts, lens, slots = [], [], []
        for start, n, s in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots, strict=True):
            if s == BASE_SLOT or n == 0 or batch.ranks[s] == 0:
                continue
            for at in range(start, start + n, BLOCK_M_PREFILL):
                starts.append(at)
                lens.append(min(BLOCK_M_PREFILL, start + n - at))
                slots.append(s)
        if not starts:
            return None
        table = torch.tensor([starts, lens, slots], dtype=torch.int32).to(device,
                                                                          non_blocking=True)
        return _Meta(T, BLOCK_M_PREFILL, table[0], table[1], table[2])

    def apply(self, x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, batch: LoRABatch,
              meta: _Meta | None) -> torch.Tensor:
        if meta is None or x.shape[0] == 0:
            return y
        assert x.stride(-1) == 1 and y.stride(-1) == 1, "x and y must be contiguous rows"
        R, slices = weights.max_rank, weights.output_slices
        if len(slices) > 3:
            raise ValueError(f"the triton LoRA backend expands at most 3 output slices (fused "
                             f"q/k/v), not {len(slices)}")
        # the slice widths go in as scalars: no offsets tensor to build (a host-to-device copy,
        # which a decode graph's capture cannot hold)
        w0, w1, w2 = (*slices, 0, 0)[:3]
        NR = len(slices) * R
        K = x.shape[1]
        bk = max(16, min(64, triton.next_power_of_2(K)))
        per_split, splits = split_k(K, bk)
        xa = meta.xa.get((NR, splits))
        if xa is None:  # one per width and split count, reused by the step's projections
            xa = meta.xa[NR, splits] = torch.empty(splits, meta.num_tokens, NR,
                                                   dtype=torch.float32, device=x.device)
        precision = "ieee" if x.dtype == torch.float32 else None
        bn = max(16, min(64, triton.next_power_of_2(NR)))
        gather = meta.perm is not None
        perm = meta.perm if gather else meta.start  # without GATHER never read
        shrink_kernel[(meta.blocks, triton.cdiv(NR, bn), splits)](
            x, weights.a, xa, meta.start, meta.length, meta.slot, perm, K, NR, per_split,
            x.stride(0), weights.a.stride(0), weights.a.stride(1), xa.stride(0), xa.stride(1),
            BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_K=bk, GATHER=gather, PRECISION=precision)
        widest = max(slices)
        bn = max(16, min(64, triton.next_power_of_2(widest)))
        br = max(16, triton.next_power_of_2(R))
        expand_kernel[(meta.blocks, len(slices), triton.cdiv(widest, bn))](
            xa, weights.b, y, weights.scalings, w0, w1, w2, meta.start,
            meta.length, meta.slot, perm, R, splits, xa.stride(0), xa.stride(1),
            weights.b.stride(0), weights.b.stride(1),
            y.stride(0), BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_R=br, GATHER=gather,
            PRECISION=precision)
        return y
