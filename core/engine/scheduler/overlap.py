"""The overlap schedule: decode step N+1 is launched before the host reads step N's tokens.

While the device runs a step, the host lands the previous one (stop checks, outputs). Only a
batch whose every request can be sampled without the host (no penalties or stop masks that need
the last token, no logprobs) chains; the device->host copy and its wait are the Platform's. The
in-flight step is this manager's; the forward, the pages and the landing of a token are the
scheduler's, given to it as functions.

Structured output chains too: its mask for step N+1 needs token N accepted by the grammar, but
the forward of step N+1 does not. So a batch with grammar rows launches forward N+1, lands step
N (the grammar accepts its tokens) and fills the masks while the device computes, then samples
N+1: the host's landing and mask work hide behind the forward instead of following it.

A request that jumps forward on landing (its grammar forced tokens after the landed one) leaves
the batch; the step launched before that landing computed a token it drops (its epoch, the
count of its jumps, changed), and it waits for the extend of its forced tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from core.engine.scheduler.request import Queues, Req, SchedulerConfig

if TYPE_CHECKING:
    import torch

    from core.engine.model_runner import ModelRunner
    from core.engine.sampling import Sampler, TokenLogprobs


class CopyWaiter(Protocol):
    """What a Platform's copy_to_host gives for a copy still under way."""

    def synchronize(self) -> None: ...


@dataclass
class InflightDecode:
    """A decode step launched on the device whose sampled tokens the host has not read yet."""

    batch: list[Req]
    tokens: torch.Tensor  # [B] on the device (the next step's input ids)
    host: torch.Tensor  # [B] on the host, filled by a non-blocking copy
    waiter: CopyWaiter | None  # the platform's waiter for that copy; None: already done
    epochs: list[int]  # each request's jump count at the launch: a jump since drops its token


class Overlap:
    """Chained decode steps (see the module doc).

    forward(input_ids) -> logits: one decode forward of the running batch (pages ensured);
    accept(req, token, logprob): a landed token joins its request's output; decode_room() ->
    bool: the pages for one more decode token each are there (evicting cache if needed)."""

    def __init__(self, cfg: SchedulerConfig, queues: Queues, sampler: Sampler,
                 runner: ModelRunner, counters: dict[str, int],
                 forward: Callable[[Sequence[int] | torch.Tensor], torch.Tensor],
                 accept: Callable[[Req, int, TokenLogprobs | None], None],
                 decode_room: Callable[[], bool]):
        self.cfg, self.q, self.sampler, self.runner = cfg, queues, sampler, runner
        self.counters = counters
        self._forward, self._accept, self._decode_room = forward, accept, decode_room
        self.inflight: InflightDecode | None = None

    def deferrable(self) -> bool:
        """The running batch may decode without the host seeing its last tokens first."""
        q = self.q
        return (self.cfg.overlap and not q.waiting and q.chunked is None
                and not q.jumped and bool(q.running)
                and all(self.sampler.deferrable(r.state, len(r.output_ids))
                        for r in q.running))

    def can_chain(self) -> bool:
        inf = self.inflight
        running = self.q.running
        if not self.deferrable() or len(running) != len(inf.batch) or any(
                a is not b for a, b in zip(running, inf.batch, strict=True)):
            return False
        return self._decode_room()

    def launch(self, input_ids: Sequence[int] | torch.Tensor, land_first: bool = False
               ) -> list[Req]:
        """Forward and sampling of one decode step for the running batch, left in flight.
        land_first (a batch with grammars): the in-flight step lands between the forward and
        the sampling, so its tokens reach the grammars before the masks are filled (in this
        thread, while the device computes the forward); returns what landing touched. Rows
        that finished on landing keep computing this step (their token is dropped at the next
        landing), so their terminated grammar is not asked for a mask."""
        batch = self.q.running
        epochs = [r.jumps for r in batch]
        logits = self._forward(input_ids)
        touched, live = [], None
        if land_first:
            touched = self.land()
            live = [r.finish is None and r.jumps == e for r, e in zip(batch, epochs, strict=True)]
        tokens = self.sampler.launch(logits, [r.state for r in batch], live=live)
        host, waiter = self.runner.platform.copy_to_host(tokens)
        self.inflight = InflightDecode(list(batch), tokens, host, waiter, epochs)
        return touched

    def chain(self) -> list[Req]:
        """Launch the next decode on the in-flight step's device tokens, then land that step."""
        prev = self.inflight
        self.counters["overlapped_steps"] += 1
        if any(r.state.matcher is not None for r in self.q.running):
            return self.launch(prev.tokens, land_first=True)
        self.launch(prev.tokens)  # replaces self.inflight
        self.inflight, launched = prev, self.inflight
        touched = self.land()
        self.inflight = launched
        return touched

    def land(self) -> list[Req]:
        """Read the in-flight step's tokens and apply them (requests finished, aborted or
        jumped forward since its launch drop theirs)."""
        inf, self.inflight = self.inflight, None
        if inf.waiter is not None:
            inf.waiter.synchronize()
        live = [(r, t) for r, t, e in zip(inf.batch, inf.host.tolist(), inf.epochs, strict=True)
                if r.finish is None and r.jumps == e]
        for r, t in live:
            r.state.observe(t)
            self._accept(r, t, None)
        self.q.running = self.q.decoding(self.q.running)
        return [r for r, _ in live]
