"""The `triton` LoRA backend (core.contract.lora): per step a block table of (start, length,
slot), then per projection one shrink launch (x @ A^T, all output slices at once) and one expand
launch (scaled @ B^T added into each slice of y). See kernels.py for the arithmetic.

Decode-sized steps (at most DECODE_TOKENS tokens) and a decode graph's device-only steps (any
bucket size: LoRABatch.device_only) get one block per token, its slot looked up on the device
from the batch's seg_indptr / seg_slots_t (searchsorted): nothing read from host lists but the
token count, no sync, grids sized by the token count alone, so a decode graph captures prepare
and apply. Longer steps get BLOCK_M-token blocks of each adapter segment, built on the host from
the segment lists (prefill is not captured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from core.contract.lora import BASE_SLOT, LoRABatch, LoRAConfig, LoRAWeights
from plugins.lora.triton.kernels import expand_kernel, shrink_kernel

DECODE_TOKENS = 64  # steps up to this many tokens: one block per token, built on the device
# The shrink's K is cut into splits of at least this many (a multiple of its BLOCK_K), at most
# MAX_SPLITS of them: at batch 1 one program per (block, column tile) looped over all of K and
# took ~36 us for 128 KB of A (H100, Llama-8B shapes, session 24's profile).
MIN_SPLIT_K = 256
MAX_SPLITS = 32
BLOCK_M_DECODE = 16  # tl.dot's smallest tile; one row of it is a token
BLOCK_M_PREFILL = 32


@dataclass
class _Meta:
    num_tokens: int
    block_m: int
    start: torch.Tensor  # [blocks] int32: first token of each block
    length: torch.Tensor  # [blocks] int32: its tokens (<= block_m)
    slot: torch.Tensor  # [blocks] int32: its adapter slot (-1: skipped)
    # shrink outputs by (width, splits): [splits, tokens, width] fp32
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
            slot = batch.seg_slots_t.index_select(0, seg).to(torch.int32)
            return _Meta(T, BLOCK_M_DECODE, t, torch.ones_like(t), slot)
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
        shrink_kernel[(meta.blocks, triton.cdiv(NR, bn), splits)](
            x, weights.a, xa, meta.start, meta.length, meta.slot, K, NR, per_split,
            x.stride(0), weights.a.stride(0), weights.a.stride(1), xa.stride(0), xa.stride(1),
            BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision)
        widest = max(slices)
        bn = max(16, min(64, triton.next_power_of_2(widest)))
        br = max(16, triton.next_power_of_2(R))
        expand_kernel[(meta.blocks, len(slices), triton.cdiv(widest, bn))](
            xa, weights.b, y, weights.scalings, w0, w1, w2, meta.start,
            meta.length, meta.slot, R, splits, xa.stride(0), xa.stride(1),
            weights.b.stride(0), weights.b.stride(1),
            y.stride(0), BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_R=br, PRECISION=precision)
        return y
