"""Prefix caches over token ids at page granularity: a radix tree that shares KV pages between
requests (LRU or LFU eviction), and a trivial cache used with --disable-radix-cache.

Ownership: a page is held either by the cache (it is in the tree) or privately by one request.
A request that matched a prefix locks the matched node; locked nodes (and their ancestors) are
never evicted. When a request finishes (or is retracted), `cache_finished` takes its pages: the
full pages go into the tree (duplicates of what the tree already holds are freed), the partial
last page is freed, and the request's lock is dropped.

A hybrid KV pool (core.engine.memory.kv_groups) gives the tree windowed groups too: a node holds,
beside its full-group pages, one positional page list per windowed group, in which pages the
request had already given back (out of its window) are that group's dummy page. A hit is usable
only up to the longest page boundary m where every windowed group still holds the pages of
positions [m - window + 1, m) (the keys the next token reads): match_prefix shortens the hit to
that point and the rest is recomputed, so a hit never reads a freed page. When a request inserts
a prefix the tree has with dummy windowed pages where the request still holds real ones, the
tree takes the request's (the next hit there can use them). Eviction frees a leaf's pages in
every group; `evict(n, group)` evicts until `group` got n pages back.

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
    __slots__ = ("children", "parent", "key", "pages", "wpages", "lock_ref", "last_access",
                 "hits")

    def __init__(self, parent: _Node | None, key: list[int], pages: list[int], tick: int,
                 wpages: list[list[int]] | None = None):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.key = key  # token ids, a whole number of pages
        self.pages = pages  # one page id per page_size tokens of key
        # per windowed group, positional like `pages`; the group's dummy page where freed
        self.wpages: list[list[int]] = wpages or []
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0


class RadixCache:
    """Radix tree of token-id keys whose values are KV pages (one per `page_size` tokens)."""

    def __init__(self, allocator: PageAllocator, page_size: int, eviction_policy: str = "lru",
                 windows: Sequence[int] = (), group_allocators: Sequence[PageAllocator] = ()):
        """windows, group_allocators: a hybrid pool's windowed groups 1.. (their allocators
        know their dummy page)."""
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"--radix-eviction-policy must be lru or lfu, not {eviction_policy!r}")
        self.allocator = allocator
        self.page_size = page_size
        self.policy = eviction_policy
        self.windows = list(windows)
        self.group_allocators = list(group_allocators)
        self._tick = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller must already have freed or handed back every page)."""
        self.roots: dict[object, _Node] = {}
        self.root = self._root(None)
        self.evictable_pages = 0
        self.protected_pages = 0
        # per windowed group: real (not dummy) pages of unlocked / locked nodes
        self.wevictable = [0] * len(self.windows)
        self.wprotected = [0] * len(self.windows)

    def _root(self, ns: object) -> _Node:
        """The root of namespace `ns`'s tree (made on first use; roots are never evicted)."""
        root = self.roots.get(ns)
        if root is None:
            root = self.roots[ns] = _Node(None, [], [], 0, [[] for _ in self.windows])
            root.lock_ref = 1
        return root

    def _wcount(self, node: _Node, g: int) -> int:
        d = self.group_allocators[g].dummy_page
        return sum(1 for p in node.wpages[g] if p != d)

    def group_evictable(self, group: int) -> int:
        """Pages of KV group `group` (0: the full group) that eviction could free now."""
        return self.evictable_pages if group == 0 else self.wevictable[group - 1]

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
        """Longest cached page-aligned prefix of `tokens` in namespace `ns` that can be used:
        (its pages, the node to lock). With windowed groups, shortened to where they still hold
        the window before it (see the module doc)."""
        pages, node = self._walk(tokens, ns)
        if self.windows and pages:
            k = self._usable_pages(self.path_wpages(node), len(pages))
            if k < len(pages):
                pages, node = self._walk(tokens[:k * self.page_size], ns)
        return pages, node

    def _usable_pages(self, wpages: list[list[int]], n: int) -> int:
        """The most leading pages k <= n of a hit such that every windowed group holds the
        pages of positions [k*ps - window + 1, k*ps)."""
        ps = self.page_size
        best = n
        for g, w in enumerate(self.windows):
            d = self.group_allocators[g].dummy_page
            run, ok = 0, [True] * (n + 1)  # ok[k]: group g allows a hit of k pages
            for i, p in enumerate(wpages[g][:n]):
                run = run + 1 if p != d else 0
                k = i + 1
                first = max(0, k * ps - w + 1) // ps  # first page the next token reads
                ok[k] = run >= k - first
            while best > 0 and not ok[best]:
                best -= 1
        return best

    def path_wpages(self, node: _Node | None) -> list[list[int]]:
        """Per windowed group, the pages of the path from the root to `node`."""
        parts = []
        while node is not None and node.parent is not None:  # up to its tree's root
            parts.append(node)
            node = node.parent
        return [[p for n in reversed(parts) for p in n.wpages[g]]
                for g in range(len(self.windows))]

    def _walk(self, tokens: Sequence[int], ns: object = None) -> tuple[list[int], _Node]:
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
        upper = _Node(node.parent, node.key[:m], node.pages[:m // ps], node.last_access,
                      [w[:m // ps] for w in node.wpages])
        upper.lock_ref = node.lock_ref
        upper.hits = node.hits
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.pages = node.key[m:], node.pages[m // ps:]
        node.wpages = [w[m // ps:] for w in node.wpages]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # -- locking --------------------------------------------------------------------------------

    def lock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:  # up to its tree's root
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
                for g in range(len(self.windows)):
                    c = self._wcount(node, g)
                    self.wevictable[g] -= c
                    self.wprotected[g] += c
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix node unlocked more often than locked"
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                for g in range(len(self.windows)):
                    c = self._wcount(node, g)
                    self.wevictable[g] += c
                    self.wprotected[g] -= c
            node = node.parent

    # -- insertion ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               wpages: list[list[int]] | None = None, owned_from: int = 0,
               ns: object = None) -> int:
        """Insert a page-aligned key in namespace `ns`; return how many of its leading pages
        the tree already had.

        Pages past that count now belong to the tree; the caller still owns (and must free) the
        ones the tree already had in its place. wpages: the windowed groups' pages (positional);
        where the tree has a dummy page and the caller, from page `owned_from` on, a real one,
        the tree takes it and the caller's entry becomes the dummy (nothing to free there).
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        wpages = wpages if wpages is not None else [[] for _ in self.windows]
        tick = next(self._tick)
        node, at = self._root(ns), 0
        while at < len(tokens):
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                i = at // ps
                new = _Node(node, list(tokens[at:]), list(pages[i:]), tick,
                            [list(w[i:len(pages)]) for w in wpages])
                node.children[self._child_key(new.key, 0)] = new
                self.evictable_pages += len(new.pages)
                for g in range(len(self.windows)):
                    self.wevictable[g] += self._wcount(new, g)
                return i
            m = self._match_len(child.key, tokens, at)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            if self.windows:
                self._take_windowed(child, wpages, at // ps, owned_from)
            at += len(child.key)
            node = child
        return len(pages)

    def _take_windowed(self, node: _Node, wpages: list[list[int]], first: int,
                       owned_from: int) -> None:
        """Fill `node`'s dummy windowed pages from the caller's real ones (page `first` of the
        caller's lists is the node's page 0; only the caller's own, from owned_from on)."""
        for g in range(len(self.windows)):
            d = self.group_allocators[g].dummy_page
            mine, theirs = node.wpages[g], wpages[g]
            for j in range(len(mine)):
                i = first + j
                if owned_from <= i < len(theirs) and mine[j] == d and theirs[i] != d:
                    mine[j], theirs[i] = theirs[i], d
                    if node.lock_ref == 0:
                        self.wevictable[g] += 1
                    else:
                        self.wprotected[g] += 1

    def cache_finished(self, tokens: Sequence[int], pages: list[int], num_shared: int,
                       node: _Node | None, wpages: list[list[int]] | None = None,
                       ns: object = None) -> None:
        """Take a request's pages for `tokens` (the ones with KV, computed in namespace `ns`);
        drop its lock on `node`. wpages: its windowed groups' pages (a hybrid pool)."""
        ps = self.page_size
        full = min(len(tokens) // ps, len(pages))
        wpages = [list(w) for w in wpages] if wpages else [[] for _ in self.windows]
        had = self.insert(tokens[:full * ps], pages[:full], wpages, owned_from=num_shared,
                          ns=ns)
        # [0, num_shared) are the tree's own pages (locked by this request); [num_shared, had)
        # duplicate pages another request inserted meanwhile; [full, ...) is the partial tail.
        self.allocator.free(pages[num_shared:had])
        self.allocator.free(pages[full:])
        for alloc, w in zip(self.group_allocators, wpages, strict=True):
            # the pages the tree took are the dummy in `w` now (insert swapped them)
            alloc.free(w[num_shared:had])
            alloc.free(w[full:])
        self.unlock(node)

    # -- eviction -------------------------------------------------------------------------------

    def _priority(self, node: _Node) -> tuple[int, int]:
        if self.policy == "lfu":
            return (node.hits, node.last_access)
        return (node.last_access, node.hits)

    def evict(self, num_pages: int, group: int = 0) -> int:
        """Free at least `num_pages` unlocked pages of KV group `group` (0: the full group),
        least valuable leaves first (a leaf's pages go in every group); return those freed."""
        heap = [(self._priority(n), id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.pages)
            if group == 0:
                freed += len(leaf.pages)
            for g, alloc in enumerate(self.group_allocators):
                c = self._wcount(leaf, g)
                alloc.free(leaf.wpages[g])
                self.wevictable[g] -= c
                if group == g + 1:
                    freed += c
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

    def cached_pages(self, group: int = 0) -> list[int]:
        """Every page the tree holds in KV group `group` (for the accounting check)."""
        if group:
            return [p for n in self._nodes() for p in n.wpages[group - 1]]
        return [p for n in self._nodes() for p in n.pages]

    @property
    def cached_tokens(self) -> int:
        return (self.evictable_pages + self.protected_pages) * self.page_size


class NoPrefixCache:
    """--disable-radix-cache: nothing is shared; a finished request's pages are freed."""

    def __init__(self, allocator: PageAllocator, page_size: int,
                 group_allocators: Sequence[PageAllocator] = ()):
        self.allocator = allocator
        self.page_size = page_size
        self.group_allocators = list(group_allocators)
        self.evictable_pages = 0
        self.protected_pages = 0

    def group_evictable(self, group: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def match_prefix(self, tokens: Sequence[int], ns: object = None) -> tuple[list[int], None]:
        return [], None

    def lock(self, node: _Node | None) -> None:
        pass

    def unlock(self, node: _Node | None) -> None:
        pass

    def cache_finished(self, tokens: Sequence[int], pages: list[int], num_shared: int,
                       node: _Node | None, wpages: list[list[int]] | None = None,
                       ns: object = None) -> None:
        self.allocator.free(pages)
        for alloc, w in zip(self.group_allocators, wpages or (), strict=False):
            alloc.free(w)

    def path_wpages(self, node: _Node | None) -> list[list[int]]:
        return [[] for _ in self.group_allocators]

    def evict(self, num_pages: int, group: int = 0) -> int:
        return 0

    def cached_pages(self, group: int = 0) -> list[int]:
        return []

    cached_tokens = 0


def make_prefix_cache(allocator: PageAllocator, page_size: int, disable: bool,
                      eviction_policy: str, windows: Sequence[int] = (),
                      group_allocators: Sequence[PageAllocator] = ()
                      ) -> RadixCache | NoPrefixCache:
    """windows, group_allocators: a hybrid pool's windowed groups (core.engine.memory.kv_groups)."""
    if disable:
        return NoPrefixCache(allocator, page_size, group_allocators)
    return RadixCache(allocator, page_size, eviction_policy, windows, group_allocators)
