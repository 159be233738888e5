"""The prefill budget: how many prompt tokens a step may extend while requests are decoding.

A step decodes the running batch (t_d seconds), then extends waiting prompts: every running
request's next token waits for both, so one chunk of --chunked-prefill-size tokens (16,384 on
an H200) stalls all of them for its whole forward. While the batch decodes, the extend is cut
to the tokens the measured extend rate fits, after the decode step, into the target inter-token
latency T (--decode-itl-target-ms; `core serve` 50 ms on an accelerator, off on a CPU and in the
offline Engine):

    budget = clamp((T - t_d) / s,  lo = max(floor, t_d / s),  hi = chunk)

- s: seconds per extended token, the ratio of two decayed sums over the extend steps so far
  (seconds, tokens), so a small extend's fixed cost weighs as little as its tokens do; at the
  budget the steps settle where t_extend(budget) = T - t_d, overhead included;
- t_d: the decode step's seconds (forward and sampling), decayed the same way;
- floor: FLOOR_TOKENS (at most the chunk), so a prompt always moves;
- t_d / s: prefill gets at least as much of a step as decode does, so where decoding alone takes
  more than T / 2 (a very large batch, a slow device) steps grow to 2 t_d rather than starve
  admission;
- chunk: the cap without running decodes (a burst's first step keeps full chunks) and until
  an extend was measured.
The budget is rounded down to GRAIN tokens. Under tensor parallelism the ranks' clocks differ,
so rank 0's budget is broadcast each turn (core.messages.PrefillBudget) and every rank cuts the
same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FLOOR_TOKENS = 256
GRAIN = 64
DECAY = 0.8  # weight of the history in each decayed sum (a step's own: 0.2)


class PrefillBudget:
    """The budget's measurements and the cap they give (module doc).

    target_ms: T (None or 0: off); chunk: the chunked-prefill size (None: chunking off, and so
    the budget, which cuts prompts into chunks); clock: seconds, monotonic (tests inject one)."""

    def __init__(self, target_ms: float | None, chunk: int | None,
                 clock: Callable[[], float] = time.perf_counter):
        self.target_s = target_ms / 1e3 if target_ms and chunk else None
        self.chunk = chunk
        self.clock = clock
        self.floor = FLOOR_TOKENS
        self._ext_s = 0.0  # decayed seconds of the extend steps
        self._ext_n = 0.0  # decayed tokens of the same steps
        self._dec_s: float | None = None  # decayed decode step seconds
        # tensor parallelism: every rank's steps take rank 0's budget of the turn (`shared`,
        # from a PrefillBudget message); the other ranks do not measure
        self.by_message = False
        self.shared: int | None = None
        self.measures = True
        self.last = 0  # the cap of the latest budgeted extend (0: none yet)
        self.capped_steps = 0  # extends the cap cut short (work was left for later steps)

    @property
    def on(self) -> bool:
        return self.target_s is not None

    @property
    def measuring(self) -> bool:
        """Whether steps are timed (and a device step waited for): the budget is on, and this
        rank computes it."""
        return self.on and self.measures

    # -- measurements ----------------------------------------------------------------------------

    def decode_timed(self, seconds: float) -> None:
        """A decode (or verify) step of the running batch took `seconds`."""
        d = self._dec_s
        self._dec_s = seconds if d is None else DECAY * d + (1 - DECAY) * seconds

    def extend_timed(self, tokens: int, seconds: float) -> None:
        """An extend forward of `tokens` tokens (and its sampling) took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._ext_n == 0:
            self._ext_s, self._ext_n = seconds, float(tokens)
            return
        self._ext_s = DECAY * self._ext_s + (1 - DECAY) * seconds
        self._ext_n = DECAY * self._ext_n + (1 - DECAY) * tokens

    @property
    def seconds_per_token(self) -> float | None:
        return self._ext_s / self._ext_n if self._ext_n else None

    @property
    def decode_s(self) -> float | None:
        return self._dec_s

    # -- the cap ---------------------------------------------------------------------------------

    def computed(self) -> int | None:
        """The cap from this rank's measurements (module doc); None: none applies (off, or no
        extend measured yet: the chunk)."""
        spt = self.seconds_per_token
        if not self.on or spt is None:
            return None
        hi = self.chunk
        t_d = self._dec_s or 0.0
        lo = max(min(self.floor, hi), t_d / spt)
        want = (self.target_s - t_d) / spt
        n = min(max(want, lo), hi)
        if n < hi:
            n = max(int(n) // GRAIN * GRAIN, min(self.floor, hi))
        return int(n)

    def cap(self, decoding: bool) -> int | None:
        """The most tokens this step's extend may take: None (the chunk) without running
        decodes or before an extend was measured; under tensor parallelism, rank 0's."""
        if not decoding or not self.on:
            return None
        return self.shared if self.by_message else self.computed()

    def stats(self) -> dict[str, int | float]:
        spt = self.seconds_per_token
        return {"prefill_budget_target_ms": round(self.target_s * 1e3, 3) if self.on else 0,
                "prefill_budget_tokens": self.last,
                "prefill_capped_steps": self.capped_steps,
                "prefill_budget_extend_tok_s": round(1 / spt, 1) if spt else 0.0,
                "prefill_budget_decode_ms": round(self._dec_s * 1e3, 3) if self._dec_s else 0.0}

    def note(self) -> str:
        """What the plan's notes say about the budget."""
        if self.chunk is None:
            return ("prefill budget off: chunked prefill is off (--chunked-prefill-size -1), "
                    "so a step's extend takes whole prompts")
        if not self.on:
            return ("prefill budget off (--decode-itl-target-ms 0, the offline Engine's "
                    "default, and `core serve`'s on a CPU; 50 on an accelerator): while "
                    f"requests decode, a step still extends up to the chunk ({self.chunk} "
                    "tokens)")
        return (f"prefill budget: while requests decode, a step extends what the measured "
                f"extend rate fits into {self.target_s * 1e3:g} ms after the decode step "
                f"(--decode-itl-target-ms), at least {min(self.floor, self.chunk)} tokens and "
                f"the decode step's time, at most the chunk ({self.chunk} tokens; the chunk "
                "too without running decodes)")
