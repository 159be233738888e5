"""Radix prefix cache: matching at page granularity, sharing, locking, LRU/LFU eviction."""

import pytest

from core.engine.memory.memory_pool import PageAllocator
from core.engine.memory.radix_cache import NoPrefixCache, RadixCache


def _finish(cache, alloc, tokens, prefix_pages=(), node=None):
    """Simulate a request holding `tokens`: shared prefix pages + fresh ones, then finishing."""
    ps = cache.page_size
    need = -(-len(tokens) // ps) - len(prefix_pages)
    pages = list(prefix_pages) + alloc.alloc(need)
    cache.cache_finished(tokens, pages, len(prefix_pages), node)
    return pages


@pytest.mark.parametrize("ps", [1, 4])
def test_match_insert_and_share(ps):
    alloc = PageAllocator(64, ps)
    cache = RadixCache(alloc, ps)
    a = list(range(100, 112))  # 12 tokens
    pages_a = _finish(cache, alloc, a)
    pages, node = cache.match_prefix(a + [1, 2])
    assert pages == pages_a[:12 // ps]
    # A prompt sharing the first 8 tokens matches 8 (whole pages only).
    b = a[:8] + [7, 7, 7, 7, 7]
    pages, node = cache.match_prefix(b)
    assert len(pages) * ps == 8 and pages == pages_a[:8 // ps]
    alloc.check_accounting(cache.cached_pages(), [])
    # The second request shares the prefix: only its own tail is new in the tree.
    cache.lock(node)
    assert cache.protected_pages == 8 // ps
    _finish(cache, alloc, b, prefix_pages=pages, node=node)
    assert cache.protected_pages == 0
    alloc.check_accounting(cache.cached_pages(), [])
    assert cache.cached_tokens == (16 if ps == 4 else 17)


def test_partial_pages_are_not_cached():
    alloc = PageAllocator(16, 4)
    cache = RadixCache(alloc, 4)
    _finish(cache, alloc, list(range(10)))  # 2 full pages + 2 tokens
    assert cache.cached_tokens == 8
    assert alloc.free_pages == 15 - 2
    pages, _ = cache.match_prefix(list(range(10)))
    assert len(pages) == 2


def test_duplicate_insert_frees_the_newcomers_pages():
    alloc = PageAllocator(32, 1)
    cache = RadixCache(alloc, 1)
    toks = [5, 6, 7, 8]
    _finish(cache, alloc, toks)
    free_before = alloc.free_pages
    # Another request computed the same tokens privately (it started before the first finished).
    _finish(cache, alloc, toks + [9])
    assert alloc.free_pages == free_before - 1  # only the page of token 9 is new
    alloc.check_accounting(cache.cached_pages(), [])


def test_locked_nodes_are_never_evicted():
    alloc = PageAllocator(16, 1)
    cache = RadixCache(alloc, 1)
    _finish(cache, alloc, [1, 2, 3, 4])
    _finish(cache, alloc, [9, 8, 7])
    pages, node = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(node)
    freed = cache.evict(100)
    assert freed == 3  # only the unlocked [9, 8, 7]
    assert cache.match_prefix([1, 2, 3, 4, 5])[0] == pages
    cache.unlock(node)
    assert cache.evict(100) == 4
    assert alloc.free_pages == alloc.total_pages
    alloc.check_accounting(cache.cached_pages(), [])


def test_lru_evicts_least_recently_used_leaf():
    alloc = PageAllocator(32, 1)
    cache = RadixCache(alloc, 1, "lru")
    _finish(cache, alloc, [1, 1, 1])
    _finish(cache, alloc, [2, 2, 2])
    cache.match_prefix([1, 1, 1, 0])  # touch the first
    cache.evict(1)
    assert cache.match_prefix([1, 1, 1, 0])[0] != []
    assert cache.match_prefix([2, 2, 2, 0])[0] == []


def test_lfu_evicts_least_frequently_used_leaf():
    alloc = PageAllocator(32, 1)
    cache = RadixCache(alloc, 1, "lfu")
    _finish(cache, alloc, [1, 1, 1])
    _finish(cache, alloc, [2, 2, 2])
    for _ in range(3):
        cache.match_prefix([1, 1, 1, 0])
    cache.match_prefix([2, 2, 2, 0])  # most recent, but used once
    cache.evict(1)
    assert cache.match_prefix([1, 1, 1, 0])[0] != []
    assert cache.match_prefix([2, 2, 2, 0])[0] == []


def test_eviction_walks_up_to_parents():
    alloc = PageAllocator(32, 2)
    cache = RadixCache(alloc, 2)
    base = [1, 2, 3, 4]
    _finish(cache, alloc, base + [5, 6])
    _finish(cache, alloc, base + [7, 8])  # splits: [1..4] -> {[5,6], [7,8]}
    assert cache.cached_tokens == 8
    assert cache.evict(100) == 4
    assert cache.cached_tokens == 0 and alloc.free_pages == alloc.total_pages


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="radix-eviction-policy"):
        RadixCache(PageAllocator(4, 1), 1, "mru")


def test_no_prefix_cache_frees_everything():
    alloc = PageAllocator(8, 1)
    cache = NoPrefixCache(alloc, 1)
    pages = alloc.alloc(3)
    assert cache.match_prefix([1, 2, 3]) == ([], None)
    cache.cache_finished([1, 2, 3], pages, 0, None)
    assert alloc.free_pages == alloc.total_pages
    alloc.check_accounting(cache.cached_pages(), [])
