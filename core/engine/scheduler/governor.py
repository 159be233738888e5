"""The speculation governor: how many drafts each request gets this step, from what its drafts
were worth so far and what a drafted token costs the step (issue 33 item 3).

A verify step over a batch of B requests with k_r drafts each forwards B + sum(k_r) tokens and
emits B + the accepted drafts. With a per-draft acceptance a_r (each draft accepted with
probability a_r once the previous one was), k drafts add E(a, k) = a + a^2 + ... + a^k tokens
in expectation; with a step costing t(T) = t0 + c * T seconds for T forwarded tokens, they cost
c * k seconds, worth c * k * B / t(B) tokens of a plain step. A request gets the k that
maximises E(a, k) - k * c * B / t(B) (none when no k gains), so speculation turns itself down
where acceptance is poor or where the forward is compute-bound (c large: big batches, a CPU's
prefill-like verify), and stays on where drafts are free (a memory-bound decode, c ~ 0).

- a_r: accepted / drafted of the request's verify steps, older steps decayed (DECAY per step),
  started from PRIOR with the weight of PRIOR_DRAFTS drafts;
- t(T): a least-squares line through the last WINDOW timed steps (plain decode steps and verify
  steps, T their forwarded tokens); until the steps seen span two sizes, c = 0;
- a request without drafts for PROBE_EVERY steps gets one, so its estimate can recover;
- `disable_batch` (vLLM's disable_by_batch_size): no drafts at all in a step with more running
  requests than that.
"""

from __future__ import annotations

from collections import deque

PRIOR, PRIOR_DRAFTS = 0.5, 2.0
DECAY = 0.9
PROBE_EVERY = 8
WINDOW = 64


def expected_accepted(a: float, k: int) -> float:
    """Drafts expected accepted of k with per-draft acceptance a: a + a^2 + ... + a^k."""
    total, p = 0.0, 1.0
    for _ in range(k):
        p *= a
        total += p
    return total


class StepCost:
    """t(T) = t0 + c * T over the last WINDOW timed steps (least squares)."""

    def __init__(self):
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """(t0, c), or None before two sizes were seen; c >= 0."""
        n = len(self.samples)
        if n < 2:
            return None
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self.samples)
        if sxx == 0:
            return None
        c = max(0.0, sum((t - mx) * (s - my) for t, s in self.samples) / sxx)
        return max(my - c * mx, 0.0), c

    def draft_price(self, batch: int) -> float:
        """What one drafted token costs, in tokens of a plain step of `batch`: c * B / t(B)."""
        line = self.line()
        if line is None:
            return 0.0
        t0, c = line
        plain = t0 + c * batch
        return c * batch / plain if plain > 0 else 0.0


class Governor:
    """Drafts per request and step (module docstring); off: the cap, always."""

    def __init__(self, on: bool = True, disable_batch: int | None = None):
        self.on, self.disable_batch = on, disable_batch
        self.cost = StepCost()
        self.seen: dict[str, tuple[float, float]] = {}  # rid -> decayed (accepted, drafted)
        self.idle: dict[str, int] = {}  # rid -> steps in a row it was given no drafts

    def acceptance(self, rid: str) -> float:
        acc, drafted = self.seen.get(rid, (0.0, 0.0))
        return (acc + PRIOR * PRIOR_DRAFTS) / (drafted + PRIOR_DRAFTS)

    def budgets(self, rids: list[str], caps: list[int],
                exempt: list[bool] | None = None) -> list[int]:
        """The drafts each request gets this step, at most its cap. An `exempt` request keeps
        its cap whatever its acceptance and the step cost say (disable_batch still applies)."""
        if self.disable_batch is not None and len(rids) > self.disable_batch:
            return [0] * len(rids)
        if not self.on:
            return list(caps)
        price = self.cost.draft_price(len(rids))
        out = []
        for rid, cap, fixed in zip(rids, caps, exempt or [False] * len(rids), strict=True):
            if fixed:
                out.append(cap)
                continue
            a, best, best_k = self.acceptance(rid), 0.0, 0
            for k in range(1, cap + 1):
                gain = expected_accepted(a, k) - k * price
                if gain > best:
                    best, best_k = gain, k
            if best_k == 0 and cap > 0:
                idle = self.idle.get(rid, 0) + 1
                if idle >= PROBE_EVERY:
                    best_k, idle = 1, 0
                self.idle[rid] = idle
            out.append(best_k)
        return out

    def step_timed(self, tokens: int, seconds: float) -> None:
        """A forward of `tokens` tokens (and its sampling) took `seconds`: kept for the cost
        line while the governor is on (off, nothing reads it)."""
        if self.on:
            self.cost.add(tokens, seconds)

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        acc, seen = self.seen.get(rid, (0.0, 0.0))
        self.seen[rid] = (acc * DECAY + accepted, seen * DECAY + drafted)
        self.idle[rid] = 0

    def forget(self, rid: str) -> None:
        self.seen.pop(rid, None)
        self.idle.pop(rid, None)
