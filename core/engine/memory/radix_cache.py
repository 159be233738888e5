"""Prefix caches over token ids at page granularity: a radix tree that shares KV pages between
requests (LRU or LFU eviction), and a trivial cache used with --disable-radix-cache.

Ownership: a page is held either by the cache (it is in the tree) or privately by one request.
A request that matched a prefix locks the matched node; locked nodes (and their ancestors) are
never evicted. When a request finishes (or is retracted), `cache_finished` takes its pages: the
full pages go into the tree (duplicates of what the tree already holds are freed), the partial
last page is freed, and the request's lock is dropped.

Prefixes are keyed by (namespace, tokens): each namespace (a LoRA adapter's load id; None for
the base model) has its own tree under its own root, so K/V computed under one adapter is never
reused for another or for the base model. Eviction and accounting span every tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from core.engine.memory.memory_pool import PageAllocator


class _Node:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access", "hits")

    def __init__(self, parent: _Node | None, key: list[int], pages: list[int], tick: int):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.key = key  # token ids, a whole number of pages
        self.pages = pages  # one page id per page_size tokens of key
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0


class RadixCache:
    """Radix tree of token-id keys whose values are KV pages (one per `page_size` tokens)."""

    def __init__(self, allocator: PageAllocator, page_size: int, eviction_policy: str = "lru"):
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"--radix-eviction-policy must be lru or lfu, not {eviction_policy!r}")
        self.allocator = allocator
        self.page_size = page_size
        self.policy = eviction_policy
        self._tick = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller must already have freed or handed back every page)."""
        self.roots: dict[object, _Node] = {}
        self.root = self._root(None)
        self.evictable_pages = 0
        self.protected_pages = 0

    def _root(self, ns: object) -> _Node:
        """The root of namespace `ns`'s tree (made on first use; roots are never evicted)."""
        root = self.roots.get(ns)
        if root is None:
            root = self.roots[ns] = _Node(None, [], [], 0)
            root.lock_ref = 1
        return root

    # -- lookup ---------------------------------------------------------------------------------

    def _child_key(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at:at + self.page_size])

    def _match_len(self, key: list[int], tokens: Sequence[int], at: int) -> int:
        """Tokens of `key` matched by tokens[at:], rounded down to whole pages."""
        n = min(len(key), len(tokens) - at)
        i = 0
        while i < n and key[i] == tokens[at + i]:
            i += 1
        return i - i % self.page_size

    def match_prefix(self, tokens: Sequence[int], ns: object = None) -> tuple[list[int], _Node]:
        """Longest cached page-aligned prefix of `tokens` in namespace `ns`: (its pages, the
        node to lock)."""
        tick = next(self._tick)
        node, at, pages = self._root(ns), 0, []
        while len(tokens) - at >= self.page_size:
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                break
            m = self._match_len(child.key, tokens, at)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            child.hits += 1
            pages.extend(child.pages)
            at += len(child.key)
            node = child
        return pages, node

    def _split(self, node: _Node, m: int) -> _Node:
        """Split `node` after its first m tokens (a page boundary); return the new upper node."""
        ps = self.page_size
        upper = _Node(node.parent, node.key[:m], node.pages[:m // ps], node.last_access)
        upper.lock_ref = node.lock_ref
        upper.hits = node.hits
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.pages = node.key[m:], node.pages[m // ps:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # -- locking --------------------------------------------------------------------------------

    def lock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:  # up to its tree's root
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix node unlocked more often than locked"
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    # -- insertion ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int], ns: object = None) -> int:
        """Insert a page-aligned key in namespace `ns`; return how many of its leading pages
        the tree already had.

        Pages past that count now belong to the tree; the caller still owns (and must free) the
        ones the tree already had in its place.
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        tick = next(self._tick)
        node, at = self._root(ns), 0
        while at < len(tokens):
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                new = _Node(node, list(tokens[at:]), list(pages[at // ps:]), tick)
                node.children[self._child_key(new.key, 0)] = new
                self.evictable_pages += len(new.pages)
                return at // ps
            m = self._match_len(child.key, tokens, at)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            at += len(child.key)
            node = child
        return len(pages)

    def cache_finished(self, tokens: Sequence[int], pages: list[int], num_shared: int,
                       node: _Node | None, ns: object = None) -> None:
        """Take a request's pages for `tokens` (the ones with KV, computed in namespace `ns`);
        drop its lock on `node`."""
        ps = self.page_size
        full = min(len(tokens) // ps, len(pages))
        had = self.insert(tokens[:full * ps], pages[:full], ns)
        # [0, num_shared) are the tree's own pages (locked by this request); [num_shared, had)
        # duplicate pages another request inserted meanwhile; [full, ...) is the partial tail.
        self.allocator.free(pages[num_shared:had])
        self.allocator.free(pages[full:])
        self.unlock(node)

    # -- eviction -------------------------------------------------------------------------------

    def _priority(self, node: _Node) -> tuple[int, int]:
        if self.policy == "lfu":
            return (node.hits, node.last_access)
        return (node.last_access, node.hits)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` unlocked pages, least valuable leaves first; return freed."""
        heap = [(self._priority(n), id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), id(parent), parent))
        return freed

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return [n for n in self._nodes() if not n.children and n.parent is not None]

    def cached_pages(self) -> list[int]:
        """Every page the tree holds (for the accounting check)."""
        return [p for n in self._nodes() for p in n.pages]

    @property
    def cached_tokens(self) -> int:
        return (self.evictable_pages + self.protected_pages) * self.page_size


class NoPrefixCache:
    """--disable-radix-cache: nothing is shared; a finished request's pages are freed."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.evictable_pages = 0
        self.protected_pages = 0

    def reset(self) -> None:
        pass

    def match_prefix(self, tokens: Sequence[int], ns: object = None) -> tuple[list[int], None]:
        return [], None

    def lock(self, node: _Node | None) -> None:
        pass

    def unlock(self, node: _Node | None) -> None:
        pass

    def cache_finished(self, tokens: Sequence[int], pages: list[int], num_shared: int,
                       node: _Node | None, ns: object = None) -> None:
        self.allocator.free(pages)

    def evict(self, num_pages: int) -> int:
        return 0

    def cached_pages(self) -> list[int]:
        return []

    cached_tokens = 0


def make_prefix_cache(allocator: PageAllocator, page_size: int, disable: bool,
                      eviction_policy: str) -> RadixCache | NoPrefixCache:
    if disable:
        return NoPrefixCache(allocator, page_size)
    return RadixCache(allocator, page_size, eviction_policy)
