"""What a speculative verify step costs against a plain decode step, acceptance aside.

`verify_vs_plain(sched, k, steps)` times the engine's own steps, in process: `steps` plain
decode steps (the proposer drafts nothing), then `steps` verify steps in which every running
request carries k random drafts (rejected almost always, so each step emits one token a
request, like a plain step; the acceptance bookkeeping of accepted drafts is the part not
timed). Both kinds are whole scheduler steps: proposing, the forward (graph rows or the eager
extend), sampling every position and the page bookkeeping.

With every draft accepted a verify step would make 1 + k tokens a request, so
(1 + k) * plain / verify estimates speculation's best case from measured costs, where forcing
acceptance is not possible (dummy bf16 weights: bench/RESULTS.md, session 24). Used by
`profile_decode.py --verify K`; tests/test_bench_spec_gpu.py runs it on the CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def verify_vs_plain(sched: Any, k: int, steps: int, sync: Callable[[], None] = lambda: None,
                    seed: int = 1) -> dict[str, float | int]:
    """The median plain and verify step times (ms) of `sched`'s running batch (its engine
    built with speculation on: `sched.spec`), their ratio, and the best-case estimate."""
    spec = sched.spec
    if spec is None:
        raise ValueError("the engine was built without speculative decoding")
    gen = torch.Generator().manual_seed(seed)
    vocab = int(sched.vocab_size)
    counts = sched.runner.forward_count

    def random_drafts(reqs):
        return [torch.randint(0, vocab, (min(k, r.max_tokens),), generator=gen).tolist()
                for r in reqs]

    proposer, out = spec.proposer, {}
    real = proposer.propose
    try:
        for name, propose in (("plain", lambda reqs: [[] for _ in reqs]),
                              ("verify", random_drafts)):
            proposer.propose = propose
            before = dict(counts)
            ms = []
            for _ in range(steps):
                sync()
                t = time.perf_counter()
                sched.step()
                sync()
                ms.append((time.perf_counter() - t) * 1e3)
            out[f"{name}_step_ms"] = statistics.median(ms)
            out[f"{name}_forwards"] = {key: n - before.get(key, 0) for key, n in counts.items()
                                       if n != before.get(key, 0)}
    finally:
        proposer.propose = real
    out["verify_vs_plain"] = out["verify_step_ms"] / out["plain_step_ms"]
    out["best_case_spec_vs_off"] = (1 + k) / out["verify_vs_plain"]
    return out
