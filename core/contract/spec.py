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


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it."""

    rid: str
    tokens: Sequence[int]  # prompt + output so far
    prompt_len: int  # how many of `tokens` are the prompt
    max_tokens: int  # propose at most this many


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
