"""The device-side block table of the `triton` LoRA backend's decode steps (torch only: no
triton import, so it is tested without the kernels).

A decode step's tokens arrive in request order, adapters interleaved. Serving them one block per
token made every token's program read its adapter's A (shrink) and B (expand) afresh: 64 reads
of each per projection at 64 requests over 8 adapters. Here the tokens are grouped by slot
instead, on the device and graph-safely: a counting sort (stable, by slot, base tokens last),
then blocks of up to `block_m` consecutive sorted tokens of one slot. Only elementwise ops,
cumsum, gather, scatter and searchsorted: no sync (torch.bincount reads its max back to the
host on CUDA, so it is not used), no host list, every shape fixed by the token count and the
slot count, so a decode graph captures it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotBlocks(NamedTuple):
    """perm [T]: sorted position -> token index (a permutation of 0..T-1: adapter tokens by
    slot, each slot's in token order, then base tokens); per block b of max_blocks(T, slots,
    block_m): start [b] its first sorted position, length [b] its tokens (0..block_m), slot [b]
    their adapter slot (-1 and length 0: an unused block). All int32."""

    perm: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor


def max_blocks(num_tokens: int, num_slots: int, block_m: int) -> int:
    """The table's fixed size, the most blocks T tokens over num_slots slots can need:
    sum over slots of cdiv(n_s, block_m), n_s = q_s * block_m + r_s, is sum q_s plus the number
    of partial blocks (r_s > 0), at most num_slots, while cdiv(T, block_m) >= sum q_s + 1 when
    there is one; so at most cdiv(T, block_m) + num_slots - 1 (all full: cdiv(T, block_m))."""
    return -(-num_tokens // block_m) + num_slots - 1


def group_by_slot(token_slot: torch.Tensor, num_slots: int, block_m: int) -> SlotBlocks:
    """The block table of a step whose token t uses slot token_slot[t] (int [T], on the device;
    -1 the base model; a slot outside 0..num_slots-1 is treated as base). See SlotBlocks."""
    if num_slots < 1 or block_m < 1:
        raise ValueError(f"group_by_slot needs a slot and a block size, not {num_slots} slots "
                         f"and blocks of {block_m}")
    device = token_slot.device
    T, S = token_slot.shape[0], num_slots
    slot = token_slot.long()
    # sort key: the slot, S for base tokens (sorted last, in no block)
    key = torch.where((slot >= 0) & (slot < S), slot, torch.full_like(slot, S))  # [T]
    onehot = (key[:, None] == torch.arange(S + 1, device=device)[None, :]).long()  # [T, S + 1]
    running = onehot.cumsum(0)  # [T, S + 1]: tokens of each key among 0..t
    counts = onehot.sum(0)  # [S + 1]
    first = counts.cumsum(0) - counts  # [S + 1]: each key's first sorted position
    # stable: token t goes after the earlier tokens of its key
    pos = first.index_select(0, key) + running.gather(1, key[:, None]).squeeze(1) - 1  # [T]
    tokens = torch.arange(T, device=device)
    perm = torch.empty_like(tokens).scatter_(0, pos, tokens)

    blocks = counts[:S].add(block_m - 1).div(block_m, rounding_mode="floor")  # [S] per slot
    ends = blocks.cumsum(0)  # [S]: one past each slot's last block
    b = torch.arange(max_blocks(T, S, block_m), device=device)  # [B]
    owner = torch.searchsorted(ends, b, right=True)  # [B]: the slot of block b (S: unused)
    used = owner < S
    s = owner.clamp(max=S - 1)
    k = b - (ends.index_select(0, s) - blocks.index_select(0, s))  # b's index among s's blocks
    start = first.index_select(0, s) + k * block_m
    length = (counts.index_select(0, s) - k * block_m).clamp(0, block_m)
    zero = torch.zeros_like(b)
    return SlotBlocks(perm.int(), torch.where(used, start, zero).int(),
                      torch.where(used, length, zero).int(),
                      torch.where(used, owner, zero - 1).int())
