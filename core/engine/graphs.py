"""Decode graphs, the engine's part: which batch sizes are captured and whether capture happens.

Bookkeeping (pure, testable anywhere): which batch sizes are captured (`graph_batch_sizes`), the
memory reserved for graphs before the KV pool is sized (`graph_memory_reserve`), and whether
capture happens at all (`decide`, which always returns a note saying why or why not: nothing is
turned off silently); `capture_graphs` asks the Platform for its graph runner and captures.
Replay and padding are the runner's base class, `core.contract.graphs.GraphRunner`, which a
hardware plugin subclasses with its `capture` (plugins/hardware/cuda_graphs.py for CUDA and
ROCm); it and the bucket helpers are re-exported here for this module's earlier importers
(tests, bench).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.contract.graphs import GraphRunner, padded_inputs, pick_bucket

if TYPE_CHECKING:
    from core.contract.platform import GraphSupport, Platform
    from core.engine.model_runner import ModelRunner

__all__ = ["GRAPH_FIXED_RESERVE", "GraphDecision", "GraphRunner", "capture_graphs", "decide",
           "graph_batch_sizes", "graph_memory_reserve", "padded_inputs", "pick_bucket"]

log = logging.getLogger("core.engine.graphs")

# Reserved for graphs beyond per-row activations: library workspaces, graph bookkeeping, the
# rotary table grown to the whole context (graphs cannot grow it mid-replay).
GRAPH_FIXED_RESERVE = 384 * 2**20


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured buckets: 1, 2, 4, 8, then every 8 up to max_bs (max_bs itself included)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def graph_memory_reserve(max_bs: int, vocab_size: int, hidden_size: int,
                         intermediate_size: int | None, dtype_bytes: int) -> int:
    """Bytes to keep free for graphs when sizing the KV pool (an estimate, on the safe side).

    Per captured row: the logits three times in fp32 (the graph's own, the static output, the
    sampler's working copy) and the widest activation (gate+up) a few times in the compute dtype.
    Buckets share one memory pool, so the largest bucket sets the size.
    """
    wide = max(hidden_size, 2 * (intermediate_size or 4 * hidden_size))
    per_row = 3 * 4 * vocab_size + 4 * wide * dtype_bytes
    return GRAPH_FIXED_RESERVE + max_bs * per_row


@dataclass(frozen=True)
class GraphDecision:
    """Whether decode graphs are captured, at which sizes, and the note that says so."""

    enabled: bool
    sizes: tuple[int, ...]
    note: str

    @property
    def max_bs(self) -> int:
        return self.sizes[-1] if self.sizes else 0


def decide(plan_cuda_graph: bool, support: GraphSupport, max_bs: int | None, default_max_bs: int,
           max_running_requests: int) -> GraphDecision:
    """Capture or not, given the plan (the resolver already turned graphs off for a decode
    backend, MoE runner or layer ops that cannot be captured, with its note), the platform's
    GraphSupport and the batch-size limits."""
    if not plan_cuda_graph:
        return GraphDecision(False, (), "graph capture off: the plan turned it off (see the "
                                        "plan's notes)")
    if not support.available:
        return GraphDecision(False, (), f"graph capture off: {support.reason}")
    if max_bs is None:
        if default_max_bs < 1:
            return GraphDecision(False, (), "graph capture off: the platform's memory "
                                            "defaults capture no batch size")
        max_bs, src = default_max_bs, "the platform's default for this device's memory"
    else:
        src = "--cuda-graph-max-bs"
    if max_bs > max_running_requests:
        max_bs, src = max_running_requests, f"capped by max_running_requests ({src})"
    sizes = tuple(graph_batch_sizes(max_bs))
    return GraphDecision(True, sizes, f"decode graphs for batch sizes up to {max_bs} ({src}); "
                                      f"larger batches run eagerly")


def capture_graphs(runner: ModelRunner, decision: GraphDecision, vocab_size: int,
                   platform: Platform) -> str:
    """Capture per `decision` with the platform's graph runner and attach it to `runner`;
    returns the note for the engine's log. A failed capture
    leaves decode eager and says why."""
    if not decision.enabled:
        log.info("%s", decision.note)
        return decision.note
    import time

    t = time.perf_counter()
    try:
        gr = platform.graph_runner(runner, decision.sizes, vocab_size)
        gr.capture()
    except Exception as exc:  # noqa: BLE001 - reported in the note and the log, decode goes eager
        note = (f"graph capture off: capture failed ({type(exc).__name__}: {exc}); decode runs "
                f"eagerly")
        log.warning("%s", note)
        return note
    runner.graph_runner = gr
    lora = ""
    if runner.lora is not None:
        lora = (" with the LoRA path (each row's adapter slot a graph input: steps serving "
                "adapters replay them)" if gr.captures_lora else
                " without LoRA deltas (the LoRA backend is not graph safe: steps serving "
                "adapters run eagerly)")
    note = (f"captured decode graphs for batch sizes {list(decision.sizes)}{lora} in "
            f"{time.perf_counter() - t:.1f} s; {decision.note}")
    log.info("%s", note)
    return note
