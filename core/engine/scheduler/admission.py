"""Admission: which waiting requests join the next extend, and who gives KV back.

Admission keeps a reserve of KV for the running requests' future tokens (SGLang's new-token
ratio, scaled by --schedule-conservativeness, which it owns); the queue is ordered by the
schedule policy (and priority); a blocked urgent request may preempt lower-priority running
ones; retraction hands a running request's KV back and queues it to be recomputed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from core.engine.scheduler.pages import Pages
from core.engine.scheduler.request import CLIP_MAX_NEW_TOKENS, Queues, Req, SchedulerConfig

LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm falls back to fcfs (matching cost)


class Admission:
    """The extend batch's choice, priority preemption, retraction, and the new-token ratio."""

    def __init__(self, cfg: SchedulerConfig, queues: Queues, pages: Pages,
                 counters: dict[str, int], on_retract: Callable[[Req], None] | None = None):
        """on_retract(req): told of each retracted request (speculation forgets it)."""
        self.cfg, self.q, self.pages, self.counters = cfg, queues, pages, counters
        self.on_retract = on_retract
        self._rng = random.Random(cfg.seed)
        self.init_ratio = min(0.7 * cfg.schedule_conservativeness, 1.0)
        self.min_ratio = min(0.1 * cfg.schedule_conservativeness, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / 600
        self.new_token_ratio = self.init_ratio

    @property
    def honours_priority(self) -> bool:
        return self.cfg.enable_priority_scheduling or self.cfg.schedule_policy == "priority"

    def decayed(self) -> None:
        """One decode step ran: the reserve shrinks toward its floor."""
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)

    # -- the order of the queue ------------------------------------------------------------------

    def order_waiting(self) -> list[Req]:
        policy = self.cfg.schedule_policy
        q = list(self.q.waiting)
        if policy == "lpm" and len(q) <= LPM_MAX_QUEUE:
            hit = {r.rid: len(self.pages.match(r)[0]) for r in q}
            q.sort(key=lambda r: (-hit[r.rid], r.seq))
        elif policy == "random":
            self._rng.shuffle(q)
        elif policy == "lof":
            q.sort(key=lambda r: (-r.params.max_new_tokens, r.seq))
        else:  # fcfs (and priority's tie-break)
            q.sort(key=lambda r: r.seq)
        if self.honours_priority:
            q.sort(key=lambda r: -r.priority)  # stable: the policy orders equal priorities
        return q

    # -- room ------------------------------------------------------------------------------------

    def room_tokens(self) -> float:
        """KV tokens admission may hand out now: free and evictable pages minus the reserve
        for the running requests' future tokens."""
        return self.pages.free_tokens() - self.reserved_tokens()

    def future_tokens(self, req: Req) -> float:
        """KV tokens admission sets aside for `req`'s future output (clipped, scaled by the
        current new-token ratio)."""
        return min(req.remaining_new(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def reserved_tokens(self) -> float:
        return sum(min(r.remaining_new(), CLIP_MAX_NEW_TOKENS) for r in self.q.holding()) \
            * self.new_token_ratio

    # a hybrid pool's windowed groups: a request holds at most window + a page there (plus the
    # extend in flight), so its future costs only what it lacks of that
    def window_future(self, req: Req, window: int) -> float:
        held = min(req.kv_len, window)
        return min(self.future_tokens(req), max(0, window + self.cfg.page_size - held))

    def window_cost(self, req: Req, now: int, window: int) -> float:
        """Windowed KV tokens admitting `req` costs: this step's `now` new tokens (all held
        during the forward), or what it will hold at most, min(len, window + a page)."""
        return max(now, min(now + self.future_tokens(req), window + self.cfg.page_size))

    def window_rooms(self) -> list[float]:
        """room_tokens of each windowed group."""
        held = self.q.holding()
        return [self.pages.group_free_tokens(g) - sum(self.window_future(r, w) for r in held)
                for g, w in enumerate(self.pages.windows, start=1)]

    def _now_tokens(self, extend: int) -> int:
        chunk = self.cfg.chunked_prefill_size
        return min(extend, chunk) if chunk else extend

    def blocked(self, req: Req) -> bool:
        """Whether `req` could not be admitted now for want of a running slot or of KV (the
        checks of admit() for a request at the head of the queue)."""
        if (len(self.q.running) >= self.cfg.max_running_requests
                or self.pages.req_to_token.free_rows == 0):
            return True
        extend = len(req.all_ids) - len(self.pages.match(req)[0]) * self.cfg.page_size
        now = self._now_tokens(extend)
        return extend + self.future_tokens(req) > self.room_tokens() or any(
            self.window_cost(req, now, w) > room
            for w, room in zip(self.pages.windows, self.window_rooms(), strict=True))

    def preempt_for_priority(self) -> None:
        """Retract running requests for the most urgent waiting one while it is blocked and
        some running request's priority is lower than its own by the threshold."""
        q = self.q
        if not self.honours_priority or not q.waiting or q.chunked is not None:
            return
        top = min(q.waiting, key=lambda r: (-r.priority, r.seq))
        floor = top.priority - self.cfg.priority_preemption_threshold
        while self.blocked(top):
            victims = [r for r in q.running if r.priority <= floor]
            if not victims:
                return
            # lowest priority first; among equals, the one with least work done
            victim = min(victims, key=lambda r: (r.priority, len(r.output_ids), -r.seq))
            self.retract(victim, preempted=True)

    # -- the extend batch ------------------------------------------------------------------------

    def admit(self, cap: int | None = None) -> list[tuple[Req, int]]:
        """Pick this step's extend batch: (request, number of new tokens to compute). cap: the
        prefill budget while requests decode (core.engine.scheduler.budget), which cuts the
        chunk to fewer tokens; the queue's order is the same."""
        q, cfg = self.q, self.cfg
        chunk = cfg.chunked_prefill_size
        rem_input = cfg.max_prefill_tokens
        rem_chunk = chunk if chunk else float("inf")
        if cap is not None:
            rem_chunk = min(rem_chunk, cap)
        items: list[tuple[Req, int]] = []
        for r in list(q.jumped):  # jump-forward: the forced tokens (and the sampled one)
            n = len(r.all_ids) - r.kv_len
            if not self.pages.grow(r, n):
                self.retract(r)  # decode holds the pool: recomputed from the queue later
                continue
            q.unjump(r)
            r.fill_len = r.kv_len + n
            items.append((r, n))
            rem_input -= n
            rem_chunk -= n
        if q.chunked is not None:
            r = q.chunked
            n = int(min(r.fill_len - r.kv_len, rem_chunk))
            if n <= 0:  # jumps took this step's chunk
                return items
            if not self.pages.grow(r, n):
                return items  # decode holds the pool; the chunk waits (or gets retracted)
            items.append((r, n))
            rem_input -= n
            rem_chunk -= n
            if r.kv_len + n < r.fill_len:
                return items
        if not q.waiting:
            return items
        rem_total = self.room_tokens()
        rem_win = self.window_rooms()
        windows = self.pages.windows
        for req in self.order_waiting():
            if len(q.running) + len(items) >= cfg.max_running_requests:
                break
            if self.pages.req_to_token.free_rows == 0 or rem_input <= 0 or rem_chunk <= 0:
                break
            all_ids = req.all_ids
            pages, node = self.pages.match(req)
            extend = len(all_ids) - len(pages) * cfg.page_size
            future = self.future_tokens(req)
            now = self._now_tokens(extend)
            win_cost = [self.window_cost(req, now, w) for w in windows]
            if (extend + future > rem_total or any(
                    c > r for c, r in zip(win_cost, rem_win, strict=True))) \
                    and (items or q.running):
                break  # keep order: later requests do not jump a request that does not fit
            n = extend
            if n > rem_chunk or (chunk and n > rem_input):
                n = int(min(rem_chunk, rem_input))
            elif n > rem_input and items:
                break
            if not self.pages.pin_adapter(req):
                continue  # its LoRA adapter waits for a free device slot; others go on
            # take it: lock its cached prefix and give it a row and pages
            self.pages.take(req, pages, node)
            req.fill_len = len(all_ids)
            if not self.pages.grow(req, n):
                self.pages.release(req)
                break
            if req.cached_tokens < 0:
                req.cached_tokens = req.kv_len
                self.counters["cached_tokens"] += req.kv_len
            q.waiting.remove(req)
            items.append((req, n))
            rem_total -= extend + future
            rem_win = [r - c for r, c in zip(rem_win, win_cost, strict=True)]
            rem_input -= n
            rem_chunk -= n
            if n < extend:
                q.chunked = req
                break
        return items

    # -- retraction ------------------------------------------------------------------------------

    def pick_victim(self) -> Req | None:
        q = self.q
        if q.chunked is not None:
            return q.chunked
        held = q.running + q.jumped
        if len(held) <= 1:
            return None
        # Like SGLang: retract the request with the fewest outputs (least work lost), and among
        # those the longest prompt (most memory back).
        return min(held, key=lambda r: (len(r.output_ids), -len(r.prompt_ids), -r.seq))

    def retract(self, req: Req, preempted: bool = False) -> None:
        """Hand `req`'s KV back and queue it to be recomputed (its output so far is kept)."""
        q = self.q
        if req is q.chunked:
            q.chunked = None
        elif req.jumping:
            q.unjump(req)
        else:
            q.running.remove(req)
        self.pages.release(req)
        q.waiting.append(req)
        if self.on_retract is not None:
            self.on_retract(req)
        if preempted:  # not a shortage of KV: admission keeps its pace
            self.counters["preemptions"] += 1
            return
        self.counters["retractions"] += 1
        # Admit more cautiously for a while: the reserve was too small.
        self.new_token_ratio = min(max(self.new_token_ratio, self.init_ratio) * 1.5, 1.0)
