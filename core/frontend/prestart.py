"""Engine worker processes spawned before the plan exists (issue 37: the start-up).

A worker spends seconds importing torch (and, for a model read through transformers, its config
classes) before it can build anything. `StartedWorker` spawns it first, so those imports run
while this process imports its own modules and resolves the plan; the plan follows as a message
(`EngineClient(..., started=worker)`). This module imports nothing heavy, so `core serve` can
spawn the worker before it imports torch itself.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.plan.args import ServerArgs


class StartedWorker:
    """A worker process spawned ahead of its plan (core.engine.worker.worker_prestarted): it imports
    torch while the parent resolves; `EngineClient(..., started=it)` sends it the plan.
    `args`: the ServerArgs the plan will be resolved from; the worker reads the model's spec,
    config and tokenizer they name while it waits (their imports, their cache entries), so
    that work is done before the plan comes. `cancel()` when the plan never comes (the worker
    then exits)."""

    def __init__(self, args: ServerArgs | None = None) -> None:
        from core.engine.worker import args_to_json, worker_prestarted  # light: no torch here

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        warm = args_to_json(args) if args is not None else None
        self.process = ctx.Process(target=worker_prestarted, args=(child, warm),
                                   name="core-engine-worker", daemon=True)
        self.process.start()
        child.close()

    def cancel(self) -> None:
        self.conn.close()
        self.process.join(timeout=15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
