"""Admission: which waiting requests join the next extend, and how KV comes back.

Admission keeps a reserve of KV for the running requests' future tokens (SGLang's new-token
ratio, scaled by --schedule-conservativeness); the queue is ordered by the schedule policy (and
priority); a blocked urgent request may preempt lower-priority running ones; retraction and
release hand KV back to the prefix cache. A mixin of core.engine.scheduler.Scheduler: the methods read
the scheduler's queue, batch, pools and config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.engine.memory.memory_pool import token_slots

if TYPE_CHECKING:
    from core.engine.scheduler import Req

CLIP_MAX_NEW_TOKENS = 4096  # reserve at most this many future tokens per request
LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm falls back to fcfs (matching cost)


class AdmissionError(ValueError):
    """A request that can never run (too long for the context or the pool, queue full...)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_fits(prompt_len: int, max_new_tokens: int, max_context: int, pool_tokens: int,
               page_size: int) -> None:
    """Raise AdmissionError if such a request could never run, with the numbers."""
    if prompt_len < 1:
        raise AdmissionError("the prompt is empty")
    total = prompt_len + max_new_tokens
    if total > max_context:
        raise AdmissionError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {total} "
            f"exceeds the context length {max_context}")
    need = -(-total // page_size) * page_size
    if need > pool_tokens:
        raise AdmissionError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} needs {need} KV "
            f"tokens; the KV pool holds {pool_tokens} (raise --max-total-tokens or "
            f"--mem-fraction-static)")


class Admission:
    """The scheduler's admission, preemption, retraction and release (see the module doc)."""

    # -- admission of waiting requests -----------------------------------------------------------

    def _order_waiting(self) -> list[Req]:
        policy = self.cfg.schedule_policy
        q = list(self.waiting)
        if policy == "lpm" and len(q) <= LPM_MAX_QUEUE:
            hit = {r.rid: len(self._match(r)[0]) for r in q}
            q.sort(key=lambda r: (-hit[r.rid], r.seq))
        elif policy == "random":
            self._rng.shuffle(q)
        elif policy == "lof":
            q.sort(key=lambda r: (-r.params.max_new_tokens, r.seq))
        else:  # fcfs (and priority's tie-break)
            q.sort(key=lambda r: r.seq)
        if self._honours_priority:
            q.sort(key=lambda r: -r.priority)  # stable: the policy orders equal priorities
        return q

    def _match(self, req: Req) -> tuple[list[int], Any]:
        """req's cached prefix (pages, node to lock); none for a request still computing prompt
        logprobs, which needs every prompt position's logits."""
        return self.cache.match_prefix([] if req.wants_prompt_lps else req.all_ids[:-1])

    @property
    def _honours_priority(self) -> bool:
        return self.cfg.enable_priority_scheduling or self.cfg.schedule_policy == "priority"

    def _blocked(self, req: Req) -> bool:
        """Whether `req` could not be admitted now for want of a running slot or of KV (the
        checks of _admit for a request at the head of the queue)."""
        if (len(self.running) >= self.cfg.max_running_requests
                or self.req_to_token.free_rows == 0):
            return True
        ps = self.cfg.page_size
        all_ids = req.all_ids
        extend = len(all_ids) - len(self._match(req)[0]) * ps
        return extend + self._future_tokens(req) > self._room_tokens()

    def _preempt_for_priority(self) -> None:
        """Retract running requests for the most urgent waiting one while it is blocked and
        some running request's priority is lower than its own by the threshold."""
        if not self._honours_priority or not self.waiting or self.chunked is not None:
            return
        top = min(self.waiting, key=lambda r: (-r.priority, r.seq))
        floor = top.priority - self.cfg.priority_preemption_threshold
        while self._blocked(top):
            victims = [r for r in self.running if r.priority <= floor]
            if not victims:
                return
            # lowest priority first; among equals, the one with least work done
            victim = min(victims, key=lambda r: (r.priority, len(r.output_ids), -r.seq))
            self._retract(victim, preempted=True)

    def _room_tokens(self) -> float:
        """KV tokens admission may hand out now: free and evictable pages minus the reserve
        for the running requests' future tokens."""
        return (self.allocator.free_pages + self.cache.evictable_pages) * self.cfg.page_size \
            - self._reserved_tokens()

    def _future_tokens(self, req: Req) -> float:
        """KV tokens admission sets aside for `req`'s future output (clipped, scaled by the
        current new-token ratio)."""
        return min(req.remaining_new(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _holding(self) -> list[Req]:
        """The requests that hold a row and KV pages: running, jumped, the chunked one."""
        return self.running + self.jumped + ([self.chunked] if self.chunked else [])

    def _reserved_tokens(self) -> float:
        return sum(min(r.remaining_new(), CLIP_MAX_NEW_TOKENS) for r in self._holding()) \
            * self.new_token_ratio

    def _admit(self) -> list[tuple[Req, int]]:
        """Pick this step's extend batch: (request, number of new tokens to compute)."""
        ps = self.cfg.page_size
        chunk = self.cfg.chunked_prefill_size
        rem_input = self.cfg.max_prefill_tokens
        rem_chunk = chunk if chunk else float("inf")
        items: list[tuple[Req, int]] = []
        for r in list(self.jumped):  # jump-forward: the forced tokens (and the sampled one)
            n = len(r.all_ids) - r.kv_len
            if not self._grow(r, n):
                self._retract(r)  # decode holds the pool: recomputed from the queue later
                continue
            self._unjump(r)
            r.fill_len = r.kv_len + n
            items.append((r, n))
            rem_input -= n
            rem_chunk -= n
        if self.chunked is not None:
            r = self.chunked
            n = int(min(r.fill_len - r.kv_len, rem_chunk))
            if n <= 0:  # jumps took this step's chunk
                return items
            if not self._grow(r, n):
                return items  # decode holds the pool; the chunk waits (or gets retracted)
            items.append((r, n))
            rem_input -= n
            rem_chunk -= n
            if r.kv_len + n < r.fill_len:
                return items
        if not self.waiting:
            return items
        rem_total = self._room_tokens()
        for req in self._order_waiting():
            if len(self.running) + len(items) >= self.cfg.max_running_requests:
                break
            if self.req_to_token.free_rows == 0 or rem_input <= 0 or rem_chunk <= 0:
                break
            all_ids = req.all_ids
            pages, node = self._match(req)
            prefix_len = len(pages) * ps
            extend = len(all_ids) - prefix_len
            future = self._future_tokens(req)
            if extend + future > rem_total and (items or self.running):
                break  # keep order: later requests do not jump a request that does not fit
            n = extend
            if n > rem_chunk or (chunk and n > rem_input):
                n = int(min(rem_chunk, rem_input))
            elif n > rem_input and items:
                break
            # take it: lock its cached prefix and give it a row and pages
            self.cache.lock(node)
            req.row = self.req_to_token.alloc()
            req.pages, req.num_shared, req.node = list(pages), len(pages), node
            req.kv_len = prefix_len
            req.fill_len = len(all_ids)
            self.req_to_token.write(req.row, 0, token_slots(pages, 0, prefix_len, ps))
            if not self._grow(req, n):
                self._release(req)
                break
            if req.cached_tokens < 0:
                req.cached_tokens = prefix_len
                self.counters["cached_tokens"] += prefix_len
            self.waiting.remove(req)
            items.append((req, n))
            rem_total -= extend + future
            rem_input -= n
            rem_chunk -= n
            if n < extend:
                self.chunked = req
                break
        return items

    def _grow(self, req: Req, n: int) -> bool:
        """Give `req` the pages for n more tokens (evicting cache if needed)."""
        need = self.allocator.pages_for(req.kv_len, n)
        if not self._ensure_pages(need):
            return False
        req.pages.extend(self.allocator.alloc(need))
        return True

    def _ensure_pages(self, need: int) -> bool:
        short = need - self.allocator.free_pages
        if short > 0:
            self.cache.evict(short)
        return self.allocator.free_pages >= need

    # -- retraction and release ------------------------------------------------------------------

    def _pick_victim(self) -> Req | None:
        if self.chunked is not None:
            return self.chunked
        held = self.running + self.jumped
        if len(held) <= 1:
            return None
        # Like SGLang: retract the request with the fewest outputs (least work lost), and among
        # those the longest prompt (most memory back).
        return min(held, key=lambda r: (len(r.output_ids), -len(r.prompt_ids), -r.seq))

    def _retract(self, req: Req, preempted: bool = False) -> None:
        if req is self.chunked:
            self.chunked = None
        elif req.jumping:
            self._unjump(req)
        else:
            self.running.remove(req)
        self._release(req)
        self.waiting.append(req)
        if preempted:  # not a shortage of KV: admission keeps its pace
            self.counters["preemptions"] += 1
            return
        self.counters["retractions"] += 1
        # Admit more cautiously for a while: the reserve was too small.
        self.new_token_ratio = min(max(self.new_token_ratio, self.init_ratio) * 1.5, 1.0)

    def _release(self, req: Req) -> None:
        """Hand a request's KV back (to the prefix cache, which frees what it does not keep)."""
        if req.row < 0:
            return
        self.cache.cache_finished(req.all_ids[:req.kv_len], req.pages, req.num_shared,
                                  req.node)
        self.req_to_token.free(req.row)
        req.row, req.pages, req.num_shared, req.node, req.kv_len = -1, [], 0, None, 0

    def _done(self, req: Req) -> None:
        self.by_id.pop(req.rid, None)
        if req.state.matcher is not None:  # finished or aborted: its grammar state goes
            req.state.matcher.close()
            req.state.matcher = None
