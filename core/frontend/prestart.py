"""Engine worker processes spawned before the plan exists (issue 37: the start-up).

A worker spends seconds importing torch (and, for a model read through transformers, its config
classes) before it can build anything. `StartedWorker` spawns it first, so those imports run
while this process imports its own modules and resolves the plan; the plan follows as a message
(`EngineClient(..., started=worker)`). This module imports nothing heavy, so `core serve` can
spawn the worker before it imports torch itself.
"""

from __future__ import annotations

import multiprocessing as mp


class StartedWorker:
    """A worker process spawned ahead of its plan (core.engine.worker.worker_prestarted): it imports
    torch while the parent resolves; `EngineClient(..., started=it)` sends it the plan.
    `warm_path`: the model path the plan will be for (None: the default model); the worker
    reads that model's spec while it waits, which imports what reading it needs (transformers'
    config classes for an HF config) before the plan comes. `cancel()` when the plan never
    comes (the worker then exits)."""

    def __init__(self, warm_path: str | None = None) -> None:
        from core.engine.worker import worker_prestarted  # light: torch is imported in the child

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_prestarted, args=(child, warm_path),
                                   name="core-engine-worker", daemon=True)
        self.process.start()
        child.close()

    def cancel(self) -> None:
        self.conn.close()
        self.process.join(timeout=15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
