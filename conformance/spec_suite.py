"""The speculative-proposer conformance tests (core/contract/spec.py): what the engine assumes
of a proposer, checked on the host in seconds (no model, no torch).

Collected by the conformance plugin (`pytest --conformance-spec NAME`, see conformance.plugin),
or by importing them into a test module:

    from conformance.spec_suite import *  # noqa: F401,F403

Parametrization: every registered proposer whose packages are installed (or only those named;
a named one that cannot run is one skip with the reason) x every case (CASES). A proposer
whose caps say needs_draft_weights is given `ToyDraft` as SpecConfig.draft: a host-only
stand-in for the engine's draft model (core.contract.spec.DraftModel) whose "model" is a fixed
function of the last tokens, so the suite loads no model; it gets the DRAFT_CASES too.

The checks, as core/contract/spec.py states them:
- protocol: the factory, given a SpecConfig, builds a core.contract.spec.Proposer.
- bounds: for every request of a batch (repetitive, random, long, with max_tokens 0..the
  config's num_draft_tokens), propose gives exactly one list per request, in order, of ints
  below the vocabulary, at most max_tokens and at most num_draft_tokens long.
- short inputs: empty, one-token and two-token requests, and an empty batch: no crash, lists
  within bounds.
- determinism: the same calls on two fresh proposers, and the same call twice on one, give
  the same drafts (greedy outputs must not depend on timing).
- lifecycle: observe (every accepted count 0..drafted) and reset (known and unknown ids, twice)
  never raise, and after reset a request's drafts are again within bounds.
- repeats: on a request that repeats a block of tokens over and over, a proposer declaring
  `chain` drafts proposes something on some step (a proposer that never drafts is useless,
  not wrong: set CORE_SPEC_CONFORMANCE_NO_REPEATS=1 for a model-based proposer the suite
  cannot feed; the case is skipped then).
- draft release (draft-model proposers): after propose and observe over a batch, reset of
  every request leaves the draft holding nothing (no KV leaked), and what it holds for a
  request is always that request's tokens followed by drafts (never another's).
- draft pool full: a draft model that cannot hold a request (forward gives None) costs that
  request its drafts, never an exception or an out-of-bounds list.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from conformance.plugin import named_plugins
from core.contract.spec import DraftRequest, Proposer, SpecConfig

__all__ = ["pytest_generate_tests", "test_spec_proposer_conformance"]

VOCAB = 512
CONFIG = SpecConfig(num_draft_tokens=4, min_match=1, max_match=6, vocab_size=VOCAB)


def _batch(seed: int) -> list[DraftRequest]:
    rng = random.Random(seed)
    block = [rng.randrange(VOCAB) for _ in range(9)]
    reqs = [
        ("repeat", block * 8, 20),
        ("random", [rng.randrange(VOCAB) for _ in range(300)], 100),
        ("long", [rng.randrange(32) for _ in range(20_000)], 10_000),
        ("tail-repeat", [rng.randrange(VOCAB) for _ in range(50)] + block * 3, 50),
    ]
    out = []
    for i, (rid, toks, plen) in enumerate(reqs):
        for k in range(CONFIG.num_draft_tokens + 1):
            out.append(DraftRequest(f"{rid}-{i}-{k}", toks, plen, k))
    return out


class ToyDraft:
    """A host-only DraftModel (core.contract.spec): per request the token ids "cached", the next
    token a fixed function of the last two and the length; `capacity` bounds the tokens it
    holds over all requests (a full pool gives None and drops the request, as the engine's)."""

    def __init__(self, vocab: int = VOCAB, capacity: int | None = None):
        self.vocab, self.capacity = vocab, capacity
        self.held: dict[str, list[int]] = {}

    def cached(self, rid: str) -> Sequence[int]:
        return tuple(self.held.get(rid, ()))

    def forward(self, rids: Sequence[str], tokens: Sequence[Sequence[int]]) -> list[int | None]:
        assert len(rids) == len(tokens) and len(set(rids)) == len(rids), \
            "forward: one token list per distinct request id"
        out: list[int | None] = []
        for rid, toks in zip(rids, tokens, strict=True):
            assert toks, f"forward: no new token for {rid}"
            seq = self.held.setdefault(rid, [])
            used = sum(len(v) for v in self.held.values())
            if self.capacity is not None and used + len(toks) > self.capacity:
                del self.held[rid]
                out.append(None)
                continue
            seq.extend(int(t) for t in toks)
            a, b = seq[-1], seq[-2] if len(seq) > 1 else 0
            out.append((a * 31 + b * 17 + len(seq)) % self.vocab)
        return out

    def truncate(self, rid: str, n: int) -> None:
        if rid in self.held:
            del self.held[rid][max(n, 0):]

    def release(self, rid: str) -> None:
        self.held.pop(rid, None)


class Builder:
    """Builds the proposer under test; for a draft-model proposer with a fresh ToyDraft each
    time (the latest in `draft`)."""

    def __init__(self, factory: Callable[[SpecConfig], object], needs_draft: bool,
                 capacity: int | None = None):
        self.factory, self.needs_draft, self.capacity = factory, needs_draft, capacity
        self.draft: ToyDraft | None = None

    def __call__(self) -> object:
        if not self.needs_draft:
            return self.factory(CONFIG)
        self.draft = ToyDraft(VOCAB, self.capacity)
        return self.factory(dataclasses.replace(CONFIG, draft=self.draft))


def check_protocol(build: Callable[[], object], seed: int) -> None:
    p = build()
    assert isinstance(p, Proposer), (f"the factory built {type(p).__name__}, which lacks "
                                     "Proposer's methods (propose, observe, reset)")


def _check_bounds(requests: Sequence[DraftRequest], got: object) -> None:
    assert isinstance(got, list), f"propose returned {type(got).__name__}, not a list"
    assert len(got) == len(requests), f"{len(got)} draft lists for {len(requests)} requests"
    for r, d in zip(requests, got, strict=True):
        assert isinstance(d, list), f"{r.rid}: drafts are {type(d).__name__}, not a list"
        assert len(d) <= min(r.max_tokens, CONFIG.num_draft_tokens), (
            f"{r.rid}: {len(d)} drafts, max_tokens {r.max_tokens}, num_draft_tokens "
            f"{CONFIG.num_draft_tokens}")
        for t in d:
            assert isinstance(t, int) and not isinstance(t, bool), f"{r.rid}: draft {t!r}"
            assert 0 <= t < VOCAB, f"{r.rid}: draft {t} outside the vocabulary of {VOCAB}"


def check_bounds(build: Callable[[], object], seed: int) -> None:
    p = build()
    reqs = _batch(seed)
    _check_bounds(reqs, p.propose(reqs))


def check_short(build: Callable[[], object], seed: int) -> None:
    p = build()
    assert p.propose([]) == [], "an empty batch gives no draft lists"
    reqs = [DraftRequest("empty", [], 0, 4), DraftRequest("one", [7], 1, 4),
            DraftRequest("two", [7, 7], 1, 4), DraftRequest("two-b", [3, 9], 2, 1)]
    _check_bounds(reqs, p.propose(reqs))


def check_determinism(build: Callable[[], object], seed: int) -> None:
    reqs = _batch(seed)
    a, b = build(), build()
    first = a.propose(reqs)
    assert first == b.propose(reqs), "two fresh proposers drafted differently"
    assert first == a.propose(reqs), "the same call twice drafted differently"


def check_lifecycle(build: Callable[[], object], seed: int) -> None:
    p = build()
    reqs = _batch(seed)
    got = p.propose(reqs)
    for r, d in zip(reqs, got, strict=True):
        for acc in range(len(d) + 1):
            p.observe(r.rid, len(d), acc)
    for r in reqs:
        p.reset(r.rid)
        p.reset(r.rid)
    p.reset("never-seen")
    _check_bounds(reqs, p.propose(reqs))


def check_repeats(build: Callable[[], object], seed: int) -> None:
    if os.environ.get("CORE_SPEC_CONFORMANCE_NO_REPEATS") == "1":
        pytest.skip("CORE_SPEC_CONFORMANCE_NO_REPEATS=1")
    p = build()
    rng = random.Random(seed)
    block = [rng.randrange(VOCAB) for _ in range(7)]
    toks = [rng.randrange(VOCAB) for _ in range(20)] + block * 6
    got = p.propose([DraftRequest("r", toks, 20, CONFIG.num_draft_tokens)])
    assert got[0], "no draft for a request that repeats one block six times"


def check_draft_release(build: Builder, seed: int) -> None:
    p = build()
    draft = build.draft
    reqs = _batch(seed)
    for step in range(3):
        got = p.propose(reqs)
        _check_bounds(reqs, got)
        for r, d in zip(reqs, got, strict=True):
            held = list(draft.cached(r.rid))
            assert held[:len(r.tokens)] == list(r.tokens)[:len(held)], (
                f"{r.rid}: the draft holds tokens that are not the request's")
            if d:
                p.observe(r.rid, len(d), step % (len(d) + 1))
    for r in reqs:
        p.reset(r.rid)
    assert not draft.held, f"after reset the draft still holds {sorted(draft.held)[:4]}"


def check_draft_full(build: Builder, seed: int) -> None:
    reqs = _batch(seed)
    for capacity in (0, 64):
        tight = Builder(build.factory, True, capacity)
        p = tight()
        _check_bounds(reqs, p.propose(reqs))
        for r in reqs:
            p.reset(r.rid)
        assert not tight.draft.held, "after reset the draft still holds requests"


@dataclass(frozen=True)
class Case:
    id: str
    check: Callable[[Callable[[], object], int], None]


CASES = (Case("protocol", check_protocol), Case("bounds", check_bounds),
         Case("short-inputs", check_short), Case("determinism", check_determinism),
         Case("reset-observe", check_lifecycle), Case("repeats", check_repeats))
DRAFT_CASES = (Case("draft-release", check_draft_release), Case("draft-full", check_draft_full))


def _missing(requires: Sequence[str]) -> list[str]:
    from core.plan.checks import missing_packages

    return missing_packages(requires)


def spec_params(config: pytest.Config) -> list:
    """pytest.param objects (proposer name, Case) for every case the options select."""
    _, proposers, named = named_plugins(config, "spec", "conformance_spec",
                                        "speculative proposer")
    params = []
    for name in named or sorted(proposers):
        caps = proposers[name].caps
        why = None
        if _missing(caps.requires):
            why = f"{name}: package {_missing(caps.requires)[0]} is not installed"
        if why is not None:
            if name in named:
                params.append(pytest.param(name, None, id=f"{name}-unavailable",
                                           marks=pytest.mark.skip(reason=why)))
            continue
        cases = CASES + (DRAFT_CASES if caps.needs_draft_weights else ())
        params += [pytest.param(name, case, id=f"{name}-{case.id}") for case in cases]
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ != "test_spec_proposer_conformance":
        return
    metafunc.parametrize("spec_name,spec_case", spec_params(metafunc.config))


def test_spec_proposer_conformance(spec_name, spec_case, request):
    from core.plan.registry import get_registry

    reg = get_registry().get("spec", spec_name)
    seed = int(request.config.getoption("conformance_seed", default=0) or 0)
    spec_case.check(Builder(reg.load(), reg.caps.needs_draft_weights), seed)
