"""KV memory: a page allocator over KVPool slots, the request-to-token table, and pool sizing.

Pages: slot s lives in page s // page_size. Page 0 holds slot 0, the padding sink, so it is never
handed out. A request owns a list of pages; its token i sits in slot
pages[i // page_size] * page_size + i % page_size, so a request's last page may be partly filled
and is extended before a new page is taken.

Accounting: every usable page is at any time exactly one of free (here), cached (held by the
prefix cache) or in use (held privately by a live request). `PageAllocator.check_accounting`
asserts that partition; the scheduler calls it with what the cache and the requests hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class OutOfPages(RuntimeError):
    """The allocator could not hand out the pages asked for (the caller evicts or retracts)."""


class PageAllocator:
    """Free list of KV pages 1..num_pages-1 (page 0 is the padding sink's)."""

    def __init__(self, num_pages: int, page_size: int, dummy_page: int | None = None):
        """dummy_page: a windowed group's (core.engine.memory.kv_groups): a page id outside
        1..num_pages-1 that page lists use for pages given back; `free` ignores it."""
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages, got {num_pages}")
        if dummy_page is not None and 0 < dummy_page < num_pages:
            raise ValueError(f"dummy page {dummy_page} is one of the allocator's pages")
        self.num_pages = num_pages
        self.page_size = page_size
        self.dummy_page = dummy_page
        # Popped from the end: low pages first, which keeps small pools easy to read in tests.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def total_pages(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, pages: Iterable[int]) -> None:
        if self.dummy_page is None:
            self._free.extend(pages)
        else:
            self._free.extend(p for p in pages if p != self.dummy_page)

    def pages_for(self, start: int, n: int) -> int:
        """New pages a request holding `start` tokens needs to hold `start + n`."""
        ps = self.page_size
        return (start + n + ps - 1) // ps - (start + ps - 1) // ps

    def check_accounting(self, cached: Iterable[int], in_use: Iterable[int]) -> None:
        """Assert free + cached + in use partitions the usable pages (no leak, no double owner)."""
        d = self.dummy_page
        free = list(self._free)
        cached = [p for p in cached if p != d]
        in_use = [p for p in in_use if p != d]
        total = len(free) + len(cached) + len(in_use)
        seen = set(free) | set(cached) | set(in_use)
        if total != self.total_pages or len(seen) != total or seen != set(
                range(1, self.num_pages)):
            dup = total - len(seen)
            raise AssertionError(
                f"KV page accounting broken: free {len(free)} + cached {len(cached)} + in use "
                f"{len(in_use)} = {total}, total {self.total_pages}; {dup} page(s) owned twice; "
                f"missing {sorted(set(range(1, self.num_pages)) - seen)[:8]}")


def token_slots(pages: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of a request's tokens [start, end) given the pages it holds."""
    if page_size == 1:
        return list(pages[start:end])
    return [pages[i // page_size] * page_size + i % page_size for i in range(start, end)]


class ReqToTokenPool:
    """Rows of the request-to-token table: req_to_token[row, i] is the slot of a request's token i.

    The table lives on the compute device ([max_reqs, max_context] int32) so that attention
    backends can gather a request's slots without a host round trip.
    """

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str,
                 groups: int = 1):
        """groups: KV groups of a hybrid pool (core.engine.memory.kv_groups): one table each,
        `tables[g]`, sharing the rows; `req_to_token` is group 0's."""
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.tables = [torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
                       for _ in range(groups)]
        self.req_to_token = self.tables[0]
        self._free: list[int] = list(range(max_reqs - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPages(f"all {self.max_reqs} request rows are in use")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, slots: Sequence[int], group: int = 0) -> None:
        if slots:
            table = self.tables[group]
            table[row, start:start + len(slots)] = torch.tensor(
                slots, dtype=torch.int32).to(table.device, non_blocking=True)


def kv_pool_tokens(*, max_total_tokens: int | None, mem_fraction_static: float | None,
                   free_bytes: int, total_bytes: int, bytes_per_token: int, page_size: int,
                   default_fraction: float, cap_tokens: int | None = None) -> tuple[int, str]:
    """How many KV tokens to allocate, and a note saying where the number came from.

    With --max-total-tokens the answer is that number. Otherwise it depends on whose memory it
    is, which the platform says through `cap_tokens` (MemoryDefaults.kv_cap_tokens):

    - None: the device is the engine's (a GPU). Like SGLang, the static part of memory (weights,
      already loaded, plus the KV cache) may use `fraction` of the device's total memory: the
      KV cache gets `free - total * (1 - fraction)`; nothing left is an error saying what to set.
    - a number: the memory is the host's, shared with every other process on it (a CPU), so
      what others hold is not counted as ours: the pool is what the model needs, `cap_tokens`,
      within `fraction` of the memory free now (`free_bytes`: this engine process's share of
      it). When that holds fewer tokens the pool starts smaller and the note says so; only
      less than two pages is an error.
    """
    fraction = mem_fraction_static if mem_fraction_static is not None else default_fraction
    flag = "--mem-fraction-static" + ("" if mem_fraction_static is not None else " default")
    if max_total_tokens is not None:
        tokens = max_total_tokens
        note = f"KV cache {tokens} tokens (--max-total-tokens)"
    elif cap_tokens is not None:
        share = int(free_bytes * fraction)
        fits = share // bytes_per_token
        tokens = min(cap_tokens, fits)
        where = (f"{flag} {fraction} of the {free_bytes / 2**20:.0f} MiB of host memory "
                 f"available to this engine process is {share / 2**20:.0f} MiB at "
                 f"{bytes_per_token} B/token")
        if fits >= cap_tokens:
            note = (f"KV cache {tokens} tokens, the default for host memory (set "
                    f"--max-total-tokens for more; {where})")
        else:
            note = (f"KV cache {tokens} tokens, fewer than the default {cap_tokens}: host memory "
                    f"is short ({where}); free memory or set --max-total-tokens")
        if tokens < 2 * page_size:
            raise ValueError(
                f"no memory left for the KV cache: {where}, less than two pages of {page_size} "
                f"tokens; free host memory, raise --mem-fraction-static or set "
                f"--max-total-tokens")
    else:
        budget = free_bytes - int(total_bytes * (1 - fraction))
        if budget < bytes_per_token * page_size * 2:
            raise ValueError(
                f"no memory left for the KV cache: {free_bytes / 2**20:.0f} MiB free of "
                f"{total_bytes / 2**20:.0f} MiB with --mem-fraction-static {fraction} leaves "
                f"{budget / 2**20:.0f} MiB; raise --mem-fraction-static or set "
                f"--max-total-tokens")
        tokens = budget // bytes_per_token
        note = (f"KV cache {tokens} tokens from --mem-fraction-static {fraction} "
                f"({budget / 2**20:.0f} MiB at {bytes_per_token} B/token)")
    tokens = (tokens // page_size) * page_size
    if tokens < 2 * page_size:
        raise ValueError(f"KV cache of {tokens} tokens is smaller than two pages of {page_size}")
    return tokens, note
