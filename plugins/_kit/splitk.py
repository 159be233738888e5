"""Split-K tile counters shared by the built-in Triton plugins' few-row products (the ops
plugin's `linear`, the quant plugins' decode GEMVs): the last program of a tile sums its
partial results in order and resets the tile's count."""

from __future__ import annotations

import torch


class LockTable:
    """Per-device int32 counts of split-K tiles, zero between calls (each call's last program
    of a tile resets its own). One table serves every layer and both plugins: the calls on a
    stream run in order. Made on the first (eager, warm-up) call, before graphs are captured."""

    _tables: dict[torch.device, torch.Tensor] = {}
    _outgrown: list[torch.Tensor] = []  # kept alive: a captured graph may still point at one

    @classmethod
    def get(cls, device: torch.device, tiles: int) -> torch.Tensor:
        t = cls._tables.get(device)
        if t is None or t.numel() < tiles:
            if t is not None:
                cls._outgrown.append(t)
            t = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
            cls._tables[device] = t
        return t
