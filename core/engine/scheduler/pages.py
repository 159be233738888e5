"""KV pages for the scheduler's requests: the page allocator, the request-to-token rows and the
prefix cache behind one manager, so that the other managers never touch the pools directly."""

from __future__ import annotations

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
                 lora: LoRAManager | None = None):
        self.allocator, self.req_to_token, self.cache = allocator, req_to_token, cache
        self.page_size = page_size
        self.lora = lora

    @property
    def pool_tokens(self) -> int:
        return self.allocator.total_pages * self.page_size

    def free_tokens(self) -> int:
        """KV tokens free or held only by evictable prefix-cache pages."""
        return (self.allocator.free_pages + self.cache.evictable_pages) * self.page_size

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

    def grow(self, req: Req, n: int) -> bool:
        """Give `req` the pages for n more tokens (evicting cache if needed)."""
        need = self.allocator.pages_for(req.kv_len, n)
        if not self.ensure(need):
            return False
        req.pages.extend(self.allocator.alloc(need))
        return True

    def ensure(self, need: int) -> bool:
        """At least `need` free pages, evicting prefix-cache pages if needed."""
        short = need - self.allocator.free_pages
        if short > 0:
            self.cache.evict(short)
        return self.allocator.free_pages >= need

    def release(self, req: Req) -> None:
        """Hand a request's KV back (to the prefix cache, which frees what it does not keep)."""
        if req.lora_slot >= 0 and self.lora is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        if req.row < 0:
            return
        self.cache.cache_finished(req.all_ids[:req.kv_len], req.pages, req.num_shared,
                                  req.node, req.lora_id)
        self.req_to_token.free(req.row)
        req.row, req.pages, req.num_shared, req.node, req.kv_len = -1, [], 0, None, 0

    def check_accounting(self, holding: list[Req]) -> None:
        """Assert free + cached + in use == total pages, with no page owned twice, and every
        request row accounted for."""
        in_use = [p for r in holding for p in r.pages[r.num_shared:]]
        self.allocator.check_accounting(self.cache.cached_pages(), in_use)
        rows = len(holding)
        assert self.req_to_token.free_rows + rows == self.req_to_token.max_reqs, \
            f"request rows leaked: {self.req_to_token.free_rows} free + {rows} held != " \
            f"{self.req_to_token.max_reqs}"
