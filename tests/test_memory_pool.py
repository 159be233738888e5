"""Page allocator, request-to-token table and KV pool sizing."""

import pytest
import torch

from core.engine.memory.memory_pool import (
    OutOfPages,
    PageAllocator,
    ReqToTokenPool,
    kv_pool_tokens,
    token_slots,
)


def test_page_zero_is_never_handed_out():
    alloc = PageAllocator(num_pages=5, page_size=4)
    assert alloc.total_pages == 4
    pages = alloc.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPages, match="asked for 1 KV pages, 0 free"):
        alloc.alloc(1)
    alloc.free(pages)
    alloc.check_accounting(cached=[], in_use=[])


def test_pages_for_extends_the_last_partial_page_first():
    alloc = PageAllocator(num_pages=10, page_size=4)
    assert alloc.pages_for(0, 1) == 1
    assert alloc.pages_for(0, 4) == 1
    assert alloc.pages_for(0, 5) == 2
    assert alloc.pages_for(3, 1) == 0  # fits in the last page's free slot
    assert alloc.pages_for(4, 1) == 1
    assert alloc.pages_for(6, 6) == 1  # 2 slots left in page 2, then 4 in a new one


def test_token_slots_follow_pages():
    assert token_slots([7, 3], 0, 6, 4) == [28, 29, 30, 31, 12, 13]
    assert token_slots([7, 3], 5, 6, 4) == [13]
    assert token_slots([5, 9, 2], 1, 3, 1) == [9, 2]


def test_accounting_catches_leaks_and_double_owners():
    alloc = PageAllocator(num_pages=6, page_size=1)
    a = alloc.alloc(2)
    b = alloc.alloc(1)
    alloc.check_accounting(cached=a, in_use=b)
    with pytest.raises(AssertionError, match="accounting broken"):
        alloc.check_accounting(cached=a, in_use=[])  # b leaked
    with pytest.raises(AssertionError, match="owned twice"):
        alloc.check_accounting(cached=a + b, in_use=b)


def test_req_to_token_rows():
    pool = ReqToTokenPool(max_reqs=2, max_context=8, device="cpu")
    assert pool.req_to_token.dtype == torch.int32 and pool.req_to_token.shape == (2, 8)
    r0, r1 = pool.alloc(), pool.alloc()
    assert {r0, r1} == {0, 1}
    with pytest.raises(OutOfPages, match="all 2 request rows"):
        pool.alloc()
    pool.write(r1, 2, [5, 6, 7])
    assert pool.req_to_token[r1].tolist() == [0, 0, 5, 6, 7, 0, 0, 0]
    pool.free(r0)
    assert pool.free_rows == 1


def test_sizing_from_max_total_tokens_rounds_to_pages():
    tokens, note = kv_pool_tokens(max_total_tokens=1000, mem_fraction_static=None, free_bytes=0,
                                  total_bytes=0, bytes_per_token=10, page_size=16,
                                  default_fraction=0.5)
    assert tokens == 992 and "--max-total-tokens" in note


def test_sizing_from_memory_fraction():
    gib = 2**30
    # total 10 GiB, 6 GiB free after weights, fraction 0.8: 6 - 10 * 0.2 = 4 GiB for KV
    tokens, note = kv_pool_tokens(max_total_tokens=None, mem_fraction_static=0.8,
                                  free_bytes=6 * gib, total_bytes=10 * gib,
                                  bytes_per_token=2**20, page_size=1, default_fraction=0.5)
    assert tokens == 4096 and "0.8" in note
    capped, note = kv_pool_tokens(max_total_tokens=None, mem_fraction_static=0.8,
                                  free_bytes=6 * gib, total_bytes=10 * gib,
                                  bytes_per_token=2**20, page_size=1, default_fraction=0.5,
                                  cap_tokens=100)
    assert capped == 100 and "the default for host memory" in note
    # host memory (a cap): fraction of what is free, never the total's complement; short: fewer
    short, note = kv_pool_tokens(max_total_tokens=None, mem_fraction_static=None,
                                 free_bytes=gib, total_bytes=10 * gib, bytes_per_token=2**20,
                                 page_size=16, default_fraction=0.5, cap_tokens=4096)
    assert short == 512 and "fewer than the default 4096: host memory is short" in note


def test_sizing_without_memory_says_what_to_do():
    with pytest.raises(ValueError, match="mem-fraction-static.*max-total-tokens"):
        kv_pool_tokens(max_total_tokens=None, mem_fraction_static=0.5, free_bytes=2**30,
                       total_bytes=4 * 2**30, bytes_per_token=1024, page_size=1,
                       default_fraction=0.5)
