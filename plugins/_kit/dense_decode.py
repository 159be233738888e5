"""A dense copy of the decode batch's K/V, carried from one decode step to the next (CPU).

Gathering every request's K/V out of the paged pool costs, per layer and step, a read and a write
of the whole padded [B, L] batch before SDPA reads it again; on a CPU that is as much time as the
attention itself. Between two decode steps of the same requests, though, only one token per
request is new. This cache keeps each layer's K/V of the batch as [B, Hkv, cap, D] (contiguous per
head, the layout SDPA reads fastest) and appends the new token, so steady decoding gathers
nothing. It is only a copy: whenever it cannot prove it still mirrors the pool, it is rebuilt
from the pool by one gather, i.e. what every step cost before.

The copy is continued, for a layer, only if all of these hold (else that layer is rebuilt):
- the step decodes the same table rows, in the same order, each one token further than the
  copy's last step, with the same slots for the tokens the copy holds, in the same pool;
- the layer was brought up to date at the copy's last step; and
- the step is the pool's next after that one (`KVPool.step`): nobody else wrote the pool in
  between, so a slot freed and written again by another request (an extend in between) is never
  read stale.
Its memory is bounded by the pool's own: B x cap never exceeds the pool's slot count.
"""

from __future__ import annotations

import torch

# Room left after the longest sequence when the copy is (re)allocated: the copy is reallocated
# (one gather) every HEADROOM decode steps at most.
HEADROOM = 128


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class DenseDecodeCache:
    """Per-layer dense K/V of the current decode batch (one instance per backend)."""

    def __init__(self):
        # per layer id: K [B, Hkv, cap, D], V [B, Hkv, cap, Dv], and the pool step (KVPool.step)
        # that last brought the layer up to date
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.layer_step: dict[int, int] = {}
        self.pool_id: int | None = None
        self.rows: torch.Tensor | None = None  # [B] table rows of the copy's last step
        self.slots: torch.Tensor | None = None  # [B, L] slots of the copy's last step
        self.lens: list[int] = []  # tokens held per row after the copy's last step
        self.cap = 0

    def begin_step(self, pool, rows: torch.Tensor, slots: torch.Tensor,
                   seq_lens: list[int]) -> tuple[int, bool, bool]:
        """Called once per decode step (in prepare): (the pool's step, usable, continued).

        usable: the copy may serve this step (else the caller gathers as usual); continued:
        the step is the copy's last step plus one token per row (layers may append)."""
        B, L = slots.shape
        prev_lens, prev_slots, prev_rows = self.lens, self.slots, self.rows
        continued = (
            self.pool_id == id(pool) and prev_rows is not None and len(prev_lens) == B
            and all(n == p + 1 for n, p in zip(seq_lens, prev_lens, strict=True))
            and L <= self.cap and torch.equal(rows, prev_rows)
            and _same_prefix(slots, prev_slots, prev_lens))
        if not continued:
            self.cap = _round_up(L + HEADROOM, 64)
        usable = B * self.cap <= pool.num_slots
        self.pool_id = id(pool)
        self.rows, self.slots, self.lens = rows.clone(), slots.clone(), list(seq_lens)
        if not usable:  # forget it: the next step must rebuild
            self.rows = None
        return pool.step, usable, continued and usable

    def layer_kv(self, layer_id: int, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 k_new: torch.Tensor, v_new: torch.Tensor, step: int, continued: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V of the batch, [B, Hkv, L, D] views, up to date with this step.

        k_new / v_new [B, Hkv, D]: the step's new tokens as the pool now holds them (already
        written); step: the pool's step (begin_step's)."""
        B, L = self.slots.shape
        k, v = self.k.get(layer_id), self.v.get(layer_id)
        # step - 1: this layer was brought up to date at the pool's previous step, so nothing
        # else wrote the pool since
        if continued and k is not None and self.layer_step.get(layer_id) == step - 1:
            pos = torch.tensor([n - 1 for n in self.lens], device=k.device)
            rows = torch.arange(B, device=k.device)
            k[rows, :, pos] = k_new.to(k.dtype)
            v[rows, :, pos] = v_new.to(v.dtype)
        else:  # rebuild from the pool: one gather, as without the copy
            if k is None or k.shape[0] != B or k.shape[2] != self.cap or k.dtype != dtype:
                # zeros, not empty: SDPA multiplies masked-out V by 0, and 0 * NaN is NaN
                k = self.k[layer_id] = torch.zeros(B, k_buf.shape[1], self.cap, k_buf.shape[2],
                                                   dtype=dtype, device=k_buf.device)
                v = self.v[layer_id] = torch.zeros(B, v_buf.shape[1], self.cap, v_buf.shape[2],
                                                   dtype=dtype, device=v_buf.device)
            idx = self.slots.reshape(-1)
            k[:, :, :L].copy_(k_buf.index_select(0, idx).view(B, L, *k_buf.shape[1:])
                              .transpose(1, 2))
            v[:, :, :L].copy_(v_buf.index_select(0, idx).view(B, L, *v_buf.shape[1:])
                              .transpose(1, 2))
        self.layer_step[layer_id] = step
        return k[:, :, :L], v[:, :, :L]


def _same_prefix(slots: torch.Tensor, prev: torch.Tensor, prev_lens: list[int]) -> bool:
    """slots[b, :prev_lens[b]] == prev[b, :prev_lens[b]] for every row b."""
    Lp = prev.shape[1]
    if slots.shape[1] < Lp:
        return False
    held = torch.arange(Lp, device=prev.device) < torch.tensor(prev_lens, device=prev.device
                                                               ).unsqueeze(1)
    return bool(((slots[:, :Lp] == prev) | ~held).all())
