"""The speculative-decoding proposer protocol (plugin kind `spec`, hook
core_register_spec_proposers, capabilities core.contract.capabilities.SpecCaps).

A proposer guesses the next tokens of running requests; the engine checks the guesses with one
forward of the target model over [last token + drafts] per request and keeps the longest prefix
the target agrees with, plus one token of its own. Verification is the engine's: greedy requests
keep drafts equal to the target's argmax, sampled ones go through rejection sampling against the
target's processed distribution (so outputs are distributed exactly as without speculation). A
proposer therefore only affects speed, never what is generated.

The engine calls, from the scheduler's thread (never concurrently):

- `propose(requests) -> list[list[int]]`: one list of draft token ids per DraftRequest, in
  order, each at most `request.max_tokens` long (an empty list: no guess for that request this
  step). `request.tokens` is the request's prompt followed by its output so far (the last
  token is the one the next forward feeds in; it has no KV yet). The engine bounds
  `max_tokens` by --speculative-num-draft-tokens, the caps' max_draft_tokens, the room left
  before max_new_tokens and the context. Drafts must be token ids below the vocabulary size the
  config gives. A proposer must bound its work per call (e.g. by a look-back window), since it
  runs on every decode step; it must not raise on short or empty token lists.
- `observe(rid, drafted, accepted)`: after verification, how many of the `drafted` tokens
  proposed for `rid` this step were accepted (0 <= accepted <= drafted). For statistics and
  adaptive proposers; a stateless proposer may ignore it.
- `reset(rid)`: the request finished, was aborted or was retracted (its output so far is kept
  and its tokens come back in later calls): forget anything kept for it. Unknown ids are fine.

Given the same calls, a proposer must give the same drafts (determinism: the conformance suite
checks it, and greedy outputs must not depend on timing). `SpecConfig` carries the user's
settings; a proposer reads those it understands and says in `notes()` what it chose.

A proposer whose caps say `needs_draft_weights` (API 1.11) is given the engine's draft model as
`SpecConfig.draft`, a `DraftModel`: the model at --speculative-draft-model-path, loaded by the
engine's loader in the draft's own load format and quantization, run on the target's device
with a paged KV pool of its own. It keeps, per request id, the tokens whose K/V it holds:
- `cached(rid) -> Sequence[int]`: those tokens (empty for an unknown id);
- `forward(rids, tokens) -> list[int | None]`: appends tokens[i] (at least one) to rid i's
  cached tokens, computing their K/V in one batch, and gives the draft model's greedy next
  token after them (below SpecConfig.vocab_size), or None for a request its pool could not
  hold this step (its K/V is then dropped: cached(rid) is empty again);
- `truncate(rid, n)`: keep the first n cached tokens only (pages past them go back);
- `release(rid)`: drop all of rid's K/V (unknown ids are fine).
The proposer keeps the draft in step with the request: it truncates to the common prefix of
cached(rid) and the request's tokens, feeds the rest, then its own drafts one by one; after
verification (observe) it truncates to what was accepted; reset(rid) must release(rid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SpecConfig:
    """The settings a proposer is built with (from --speculative-* flags)."""

    num_draft_tokens: int = 4  # most drafts per request and step
    min_match: int = 1  # ngram-style proposers: shortest suffix that must match
    max_match: int = 12  # longest suffix tried (the look-up's work bound)
    vocab_size: int = 0  # drafts must lie below it (0: unknown)
    # the engine's draft model (a DraftModel), for proposers whose caps need draft weights;
    # None for the others
    draft: DraftModel | None = None


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it."""

    rid: str
    tokens: Sequence[int]  # prompt + output so far
    prompt_len: int  # how many of `tokens` are the prompt
    max_tokens: int  # propose at most this many


@runtime_checkable
class DraftModel(Protocol):
    """The engine's draft model with its own paged KV pool (see the module doc)."""

    def cached(self, rid: str) -> Sequence[int]:
        """The tokens of rid whose K/V the draft holds, in order (empty: none)."""
        ...

    def forward(self, rids: Sequence[str], tokens: Sequence[Sequence[int]]
                ) -> list[int | None]:
        """Append tokens[i] to rids[i]'s cached tokens (one batch); the greedy next token
        after each, or None where the pool could not hold the request (its K/V dropped)."""
        ...

    def truncate(self, rid: str, n: int) -> None:
        """Keep rid's first n cached tokens only."""
        ...

    def release(self, rid: str) -> None:
        """Drop all of rid's K/V (unknown ids are fine)."""
        ...


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for running requests (see the module doc)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """One draft list per request, each at most request.max_tokens long."""
        ...

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        """How many of this step's drafts for rid the target accepted."""
        ...

    def reset(self, rid: str) -> None:
        """Forget rid (finished, aborted or retracted)."""
        ...
