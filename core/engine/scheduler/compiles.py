"""Constrained requests waiting for their grammar: one compile per constraint at a time (in the
grammar's compile processes, core.engine.grammar_compiler), the requests parked on it, and what
happens when it ends (their matcher, or their refusal) or when the last of them leaves (the
compile is stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.engine.scheduler.request import Queues, Req

if TYPE_CHECKING:
    from concurrent.futures import Future

    from core.contract.grammar import Constraint, Grammar


class Compiles:
    """The `compiling` queue's manager."""

    def __init__(self, grammar: Grammar | None, queues: Queues, counters: dict[str, int]):
        self.grammar = grammar  # None: structured output off
        self.q, self.counters = queues, counters
        # id: (constraint, the future of its compiled grammar, the requests waiting on it)
        self._compiles: dict[int, tuple[Constraint, Future[object], list[Req]]] = {}
        self._compile_ids: dict[tuple[str, str], int] = {}  # constraint key: id
        self._next = 0

    def __bool__(self) -> bool:
        return bool(self._compiles)

    def park(self, req: Req) -> None:
        """Park `req` in `compiling` on its grammar's compile (one per constraint at a time)."""
        key = req.params.constraint.key()
        cid = self._compile_ids.get(key)
        if cid is None:
            cid = self._compile_ids[key] = self._next
            self._next += 1
            self._compiles[cid] = (req.params.constraint,
                                   self.grammar.submit(req.params.constraint), [])
        self._compiles[cid][2].append(req)
        req.compile_id = cid
        self.q.compiling.append(req)

    def ready(self) -> list[int]:
        """The ids of the compiles that are done (in start order)."""
        return [cid for cid, (_, fut, _) in self._compiles.items() if fut.done()]

    def done(self, ids: list[int]) -> list[Req]:
        """Move the requests of these finished compiles on: to `waiting` with their matcher;
        those refused (400 for a refusal, 500 for a backend failure) are returned, finished.
        Waits for a compile not yet done here (a rank told by rank 0)."""
        refused = []
        for cid in ids:
            constraint, fut, reqs = self._compiles.pop(cid)
            del self._compile_ids[constraint.key()]
            try:
                compiled = fut.result()
            except ValueError as exc:
                compiled, error = None, exc
            else:
                self.grammar.store(constraint, compiled)
            for req in reqs:
                self.q.compiling.remove(req)
                req.compile_id = None
                if compiled is not None:
                    req.state.matcher = self.grammar.matcher_of(compiled)
                    self.q.waiting.append(req)
                    continue
                self.counters["rejected"] += 1
                req.finish = {"type": "abort", "message": str(error),
                              "status_code": getattr(error, "status", 400)}
                refused.append(req)
        return refused

    def leave(self, req: Req) -> None:
        """`req` (in `compiling`) is aborted; a compile nobody waits for any more is stopped
        (every tensor-parallel rank does the same, in the same order)."""
        self.q.compiling.remove(req)
        cid, req.compile_id = req.compile_id, None
        constraint, fut, reqs = self._compiles[cid]
        reqs.remove(req)
        if not reqs:
            del self._compiles[cid], self._compile_ids[constraint.key()]
            self.grammar.cancel(fut)
