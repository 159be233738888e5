"""KV pages for the scheduler's requests: the page allocator, the request-to-token rows and the
prefix cache behind one manager, so that the other managers never touch the pools directly.

With a hybrid KV pool (core.engine.memory.kv_groups) there are windowed groups 1.. beside the
full group 0: each has its allocator and table; a request's pages in them are positional like
its full-group pages, and `trim` gives back (to the group's allocator, the entry becoming the
group's dummy page, in the list and the table) the pages no later token can read, nor a prefix
hit on its tokens cut to whole pages: those wholly before position m - window + 1, m = kv_len
rounded down to a page (so a request holds at most window + one page there when the window is
a multiple of the page, plus the extend in flight). Pages shared with the prefix cache are the cache's: never
trimmed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.engine.memory.memory_pool import PageAllocator, ReqToTokenPool, token_slots
from core.engine.scheduler.request import Req

if TYPE_CHECKING:
    from core.engine.lora import LoRAManager
    from core.engine.memory.radix_cache import NoPrefixCache, RadixCache, _Node


class Pages:
    """Gives requests rows and pages (and their LoRA adapter's device slot), takes them back to
    the prefix cache."""

    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 cache: RadixCache | NoPrefixCache, page_size: int,
                 windows: Sequence[int] = (), group_allocators: Sequence[PageAllocator] = (),
                 lora: LoRAManager | None = None):
        """windows, group_allocators: the windowed groups 1.. of a hybrid pool; lora: the LoRA
        adapters' device slots (None without --enable-lora)."""
        self.allocator, self.req_to_token, self.cache = allocator, req_to_token, cache
        self.page_size = page_size
        self.lora = lora
        self.windows = list(windows)
        self.group_allocators = list(group_allocators)
        if len(self.windows) != len(self.group_allocators) or \
                len(req_to_token.tables) != 1 + len(self.windows):
            raise ValueError("a hybrid KV pool needs one allocator and one table per group")

    @property
    def allocators(self) -> list[PageAllocator]:
        """Every group's allocator, the full group's first."""
        return [self.allocator, *self.group_allocators]

    @property
    def pool_tokens(self) -> int:
        return self.allocator.total_pages * self.page_size

    def group_pool_tokens(self, group: int) -> int:
        return self.allocators[group].total_pages * self.page_size

    def free_tokens(self) -> int:
        """KV tokens free or held only by evictable prefix-cache pages."""
        return (self.allocator.free_pages + self.cache.evictable_pages) * self.page_size

    def group_free_tokens(self, group: int) -> int:
        """free_tokens of KV group `group`."""
        if group == 0:
            return self.free_tokens()
        return (self.allocators[group].free_pages + self.cache.group_evictable(group)) \
            * self.page_size

    def match(self, req: Req) -> tuple[list[int], _Node | None]:
        """req's cached prefix (pages, node to lock); none for a request still computing prompt
        logprobs, which needs every prompt position's logits."""
        return self.cache.match_prefix([] if req.wants_prompt_lps else req.all_ids[:-1],
                                       req.lora_id)

    def pin_adapter(self, req: Req) -> bool:
        """Give `req` a device slot holding its LoRA adapter (held until `release`); False
        when every slot is held by other adapters' requests (it waits; others go on)."""
        if req.lora_id is None or self.lora is None:
            return True
        slot = self.lora.acquire(req.lora_id)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def take(self, req: Req, pages: list[int], node: _Node | None) -> None:
        """Admit `req` over its cached prefix: lock it, give it a row holding the prefix."""
        ps = self.page_size
        self.cache.lock(node)
        req.row = self.req_to_token.alloc()
        req.pages, req.num_shared, req.node = list(pages), len(pages), node
        req.kv_len = len(pages) * ps
        self.req_to_token.write(req.row, 0, token_slots(pages, 0, req.kv_len, ps))
        if self.windows:
            req.wpages = [w[:len(pages)] for w in self.cache.path_wpages(node)]
            req.wtrimmed = [0] * len(self.windows)
            for g, w in enumerate(req.wpages, start=1):
                self.req_to_token.write(req.row, 0, token_slots(w, 0, req.kv_len, ps), group=g)

    def grow(self, req: Req, n: int) -> bool:
        """Give `req` the pages for n more tokens (evicting cache if needed)."""
        need = self.allocator.pages_for(req.kv_len, n)
        if not self.ensure(need):
            return False
        self.add_pages(req, need)
        return True

    def add_pages(self, req: Req, n: int) -> None:
        """n more pages for `req` in every group (ensured first)."""
        req.pages.extend(self.allocator.alloc(n))
        for w, alloc in zip(req.wpages, self.group_allocators, strict=True):
            w.extend(alloc.alloc(n))

    def ensure(self, need: int) -> bool:
        """At least `need` free pages in every group, evicting prefix-cache pages if needed."""
        for g, alloc in enumerate(self.allocators):
            short = need - alloc.free_pages
            if short > 0:
                self.cache.evict(short, g)
            if alloc.free_pages < need:
                return False
        return True

    def slots(self, req: Req, start: int, end: int) -> tuple[list[int], list[list[int]]]:
        """Slots of req's tokens [start, end): the full group's, then each windowed group's."""
        ps = self.page_size
        return (token_slots(req.pages, start, end, ps),
                [token_slots(w, start, end, ps) for w in req.wpages])

    def truncate(self, req: Req, num_pages: int) -> None:
        """Give back req's pages past the first `num_pages` (they hold no token it keeps)."""
        if len(req.pages) > num_pages:
            self.allocator.free(req.pages[num_pages:])
            del req.pages[num_pages:]
            for w, alloc in zip(req.wpages, self.group_allocators, strict=True):
                alloc.free(w[num_pages:])
                del w[num_pages:]

    def trim(self, req: Req) -> None:
        """Give back req's windowed pages that no later token reads (see the module doc)."""
        if not self.windows or req.row < 0:
            return
        ps = self.page_size
        for g, (w, alloc, win) in enumerate(zip(req.wpages, self.group_allocators, self.windows,
                                                strict=True)):
            # the first page a token at the last page boundary reads: what a prefix-cache hit
            # on this request's tokens (cut to whole pages) needs, so it is kept too
            first = max(0, req.kv_len // ps * ps - win + 1) // ps
            i = max(req.wtrimmed[g], req.num_shared)
            if i >= first:
                continue
            d = alloc.dummy_page
            alloc.free(w[i:first])
            w[i:first] = [d] * (first - i)
            # the table too: the entries point at the dummy page (zeros), never at a page
            # another request may write with values (NaN included) a masked read would see
            self.req_to_token.tables[g + 1][req.row, i * ps:first * ps] = d * ps
            req.wtrimmed[g] = first

    def release(self, req: Req) -> None:
        """Hand a request's KV back (to the prefix cache, which frees what it does not keep)."""
        if req.lora_slot >= 0 and self.lora is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        if req.row < 0:
            return
        self.cache.cache_finished(req.all_ids[:req.kv_len], req.pages, req.num_shared,
                                  req.node, req.wpages if self.windows else None,
                                  ns=req.lora_id)
        self.req_to_token.free(req.row)
        req.row, req.pages, req.num_shared, req.node, req.kv_len = -1, [], 0, None, 0
        req.wpages, req.wtrimmed = [], []

    def check_accounting(self, holding: list[Req]) -> None:
        """Assert free + cached + in use == total pages, with no page owned twice, in every
        group, and every request row accounted for."""
        in_use = [p for r in holding for p in r.pages[r.num_shared:]]
        self.allocator.check_accounting(self.cache.cached_pages(), in_use)
        for g, alloc in enumerate(self.group_allocators):
            alloc.check_accounting(self.cache.cached_pages(g + 1),
                                   [p for r in holding for p in r.wpages[g][r.num_shared:]])
        rows = len(holding)
        assert self.req_to_token.free_rows + rows == self.req_to_token.max_reqs, \
            f"request rows leaked: {self.req_to_token.free_rows} free + {rows} held != " \
            f"{self.req_to_token.max_reqs}"
