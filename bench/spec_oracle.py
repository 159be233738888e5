"""`bench_oracle`: a BENCH-ONLY speculative proposer that replays the greedy continuation an
earlier run (speculation off) recorded for each prompt, so acceptance is forced, not hoped for.

It measures what verification costs and gains when every draft is right (issue 33's H200
table: dummy weights give no real acceptance to hope for). It says nothing about how good any
real proposer is, and it is never an installed entry point: bench/bench_spec_gpu.py registers
it for its own engines only (`oracle_site` writes a throw-away dist-info whose `core.plugins`
entry point names this module; the engine's worker process finds it on the sys.path it is
spawned with) and hands it the recording through the file named by $BENCH_SPEC_ORACLE_FILE.

Per request it drafts the next k recorded tokens while the request's output so far equals the
recording; once it departs (a prompt not recorded, or the target chose another token: batch or
kernel numerics differ between the recording and the verify forward) it drafts nothing more
for that request, so a departure shows as lower tokens per step and as an output mismatch,
never as drafts the target has to reject.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.contract.capabilities import SpecCaps
from core.contract.hookspecs import hookimpl
from core.contract.spec import DraftRequest, SpecConfig

CORE_PLUGIN_API = ">=1.9,<2"

NAME = "bench_oracle"
FILE_ENV = "BENCH_SPEC_ORACLE_FILE"
ENTRY_POINT = "bench_spec_oracle"  # the throw-away dist-info's name for this module

CAPS = SpecCaps(
    devices=("*",), draft_shapes=("chain",), max_draft_tokens=16, needs_draft_weights=False,
    graph_safe=False, grammars=False, tensor_parallel=False,
    description="BENCH ONLY: replays the recorded greedy continuation of each prompt "
                "(forced acceptance; bench/bench_spec_gpu.py)")


def write_recording(path: Path, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    """The recording the oracle reads: (prompt ids, greedy output ids) per request."""
    path.write_text(json.dumps([[list(p), list(o)] for p, o in pairs]))


def read_recording(path: str | Path) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): list(o) for p, o in json.loads(Path(path).read_text())}


@dataclass
class _Track:
    """One request's place in its recording."""

    record: list[int] | None  # None: its prompt was not recorded
    checked: int = 0  # output tokens found equal to the recording so far
    departed: bool = False


class OracleProposer:
    """Drafts the recorded continuation (module doc). Deterministic: the drafts depend on the
    request's tokens and the recording only."""

    def __init__(self, config: SpecConfig,
                 recording: dict[tuple[int, ...], list[int]] | None = None):
        if recording is None:
            path = os.environ.get(FILE_ENV)
            if not path:
                raise ValueError(f"{NAME}: ${FILE_ENV} names no recording (the proposer is "
                                 "bench/bench_spec_gpu.py's, not for serving)")
            recording = read_recording(path)
        self.config, self.recording = config, recording
        self.tracks: dict[str, _Track] = {}

    def notes(self) -> list[str]:
        return [f"{NAME} proposer (BENCH ONLY, forced acceptance): replays the recorded greedy "
                f"continuations of {len(self.recording)} prompts, up to "
                f"{self.config.num_draft_tokens} drafts"]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._draft(r) for r in requests]

    def _draft(self, r: DraftRequest) -> list[int]:
        k = min(r.max_tokens, self.config.num_draft_tokens)
        t = self.tracks.get(r.rid)
        if t is None:
            t = self.tracks[r.rid] = _Track(self.recording.get(tuple(r.tokens[:r.prompt_len])))
        if k <= 0 or t.record is None or t.departed:
            return []
        n = len(r.tokens) - r.prompt_len  # output tokens so far
        # only the tokens emitted since the last call are compared (O(new) per step)
        if n > len(t.record) or list(r.tokens[r.prompt_len + t.checked:]) != \
                t.record[t.checked:n]:
            t.departed = True
            return []
        t.checked = n
        drafts = t.record[n:n + k]
        vocab = self.config.vocab_size
        bad = next((i for i, x in enumerate(drafts) if vocab and not 0 <= x < vocab), None)
        return drafts if bad is None else drafts[:bad]  # (a recording of this model: none)

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        pass

    def reset(self, rid: str) -> None:
        self.tracks.pop(rid, None)


@hookimpl
def core_register_spec_proposers(register):
    register(NAME, CAPS, OracleProposer)
