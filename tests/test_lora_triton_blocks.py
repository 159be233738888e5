"""The triton LoRA backend's decode block table (plugins/lora/triton/blocks.py, torch only): the
tokens grouped by slot cover every adapter token exactly once, base tokens none, a block never
mixes slots nor holds more than block_m tokens, the table's fixed size is never short; on a GPU
it is built with no sync and replays in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from plugins.lora.triton.blocks import group_by_slot, max_blocks


def check_table(token_slot: torch.Tensor, num_slots: int, block_m: int) -> None:
    T = token_slot.shape[0]
    table = group_by_slot(token_slot, num_slots, block_m)
    slots = token_slot.tolist()
    perm, start, length, slot = (t.tolist() for t in table)
    B = max_blocks(T, num_slots, block_m)
    assert all(t.dtype == torch.int32 for t in table)
    assert len(start) == len(length) == len(slot) == B
    assert sorted(perm) == list(range(T)), "perm is not a permutation of the tokens"
    # sorted order: by slot, base tokens last, each slot's tokens in token order (stable)
    key = [s if 0 <= s < num_slots else num_slots for s in slots]
    assert [(key[t], t) for t in perm] == sorted((key[t], t) for t in range(T))
    served = []
    for b in range(B):
        n = length[b]
        assert 0 <= n <= block_m, f"block {b}: {n} tokens over block_m {block_m}"
        assert (slot[b] == -1) == (n == 0), f"block {b}: slot {slot[b]} with {n} tokens"
        toks = perm[start[b]:start[b] + n]
        assert len(toks) == n, f"block {b} runs past the tokens"
        assert all(slots[t] == slot[b] for t in toks), f"block {b} mixes slots"
        served += toks
    want = [t for t in range(T) if 0 <= slots[t] < num_slots]
    assert sorted(served) == want, "adapter tokens not each in exactly one block"


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_random_steps(block_m):
    g = torch.Generator().manual_seed(0)
    for T in (0, 1, 2, 5, 16, 17, 33, 64, 100, 257):
        for S in (1, 3, 8):
            for _ in range(3):
                check_table(torch.randint(-1, S, (T,), generator=g, dtype=torch.int32), S,
                            block_m)


@pytest.mark.parametrize("slots", [
    [],  # an empty step
    [2],  # a single token
    [-1] * 9,  # every token base (or padding)
    [0] * 40,  # one slot only, 40 > 2 blocks of 16
    [1, -1, 1, 0, 1, 1, -1, 2, 1] * 5,  # one adapter interleaved with others and base
    [0] * 17 + [1] * 17 + [2] * 17 + [3] * 17,  # every slot one over a block: the worst case
    [3, 9, -4, 0],  # out-of-range slots count as base
])
def test_chosen_steps(slots):
    check_table(torch.tensor(slots, dtype=torch.int32), 4, 16)


def test_the_worst_case_fills_the_table():
    # every slot's count one past a multiple of block_m: every block of the table used
    for T, S in ((68, 4), (4, 4), (8 * 17, 8), (1, 1)):
        table = group_by_slot(torch.arange(T, dtype=torch.int32) % S, S, 16)
        assert int((table.length > 0).sum()) == max_blocks(T, S, 16)


def test_refuses_no_slots():
    with pytest.raises(ValueError, match="needs a slot"):
        group_by_slot(torch.zeros(3, dtype=torch.int32), 0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_built_without_sync_and_replayed_in_a_cuda_graph():
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    slots = torch.randint(-1, 8, (256,), generator=g, dtype=torch.int32).to(device)
    group_by_slot(slots, 8, 16)  # warm up outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        group_by_slot(slots, 8, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table = group_by_slot(slots, 8, 16)
    for _ in range(3):
        slots.copy_(torch.randint(-1, 8, (256,), generator=g, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = group_by_slot(slots, 8, 16)
        for got, ref in zip(table, want, strict=True):
            assert torch.equal(got, ref)
        check_table(slots.cpu(), 8, 16)
