"""The reference LoRA backend (core.contract.lora): for every adapter slot in the step, its
tokens are gathered, multiplied by A then B of each output slice, scaled and added back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.contract.lora import BASE_SLOT, LoRABatch, LoRAConfig, LoRAWeights


@dataclass
class _Group:
    slot: int
    rank: int
    index: torch.Tensor | None  # [n] token indices (None: the slot's tokens are one run)
    start: int
    length: int


class TorchNativeLoRA:
    """Groups the step's tokens by slot once (prepare), then two matmuls per slot and slice."""

    def __init__(self, config: LoRAConfig):
        self.config = config

    def prepare(self, batch: LoRABatch) -> list[_Group]:
        runs: dict[int, list[tuple[int, int]]] = {}
        for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots,
                                  strict=True):
            if slot != BASE_SLOT and n > 0 and batch.ranks[slot] > 0:
                runs.setdefault(slot, []).append((start, n))
        groups = []
        for slot, spans in runs.items():
            if len(spans) == 1:  # one contiguous run: a view, no gather
                groups.append(_Group(slot, batch.ranks[slot], None, *spans[0]))
                continue
            idx = torch.cat([torch.arange(s, s + n) for s, n in spans])
            groups.append(_Group(slot, batch.ranks[slot],
                                 idx.to(self.config.device, non_blocking=True), 0, len(idx)))
        return groups

    def apply(self, x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, batch: LoRABatch,
              meta: list[_Group]) -> torch.Tensor:
        R = weights.max_rank
        for g in meta:
            xs = x[g.start:g.start + g.length] if g.index is None else x.index_select(0, g.index)
            scale = weights.scalings[g.slot].to(x.dtype)
            a, b = weights.a[g.slot], weights.b[g.slot]  # [n_slices * R, in], [out, R]
            parts, off = [], 0
            for j, width in enumerate(weights.output_slices):
                xa = xs @ a[j * R:j * R + g.rank].T  # [n, rank]
                parts.append(xa @ b[off:off + width, :g.rank].T)  # [n, width]
                off += width
            delta = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)) * scale
            if g.index is None:
                y[g.start:g.start + g.length] += delta
            else:
                y.index_add_(0, g.index, delta)
        return y
