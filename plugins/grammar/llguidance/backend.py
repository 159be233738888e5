"""The llguidance backend (core.contract.grammar.GrammarBackend); imported only when it is chosen."""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg
import llguidance.hf

from core.contract.grammar import Constraint, GrammarError

_WHAT = {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
         "regex": "invalid regex", "ebnf": "invalid EBNF grammar", "choice": "invalid choices"}
# JSON without free whitespace (small models loop on it); lenient off: an unimplemented keyword
# is an error, never ignored. Overrides win over a schema's own "x-guidance" options.
_JSON = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}


def _clean(msg: str) -> str:
    """llguidance's message in one line: a regex parse error's `error:` line, else the first."""
    lines = [s.strip() for s in msg.strip().splitlines() if s.strip()]
    why = next((s[len("error:"):].strip() for s in lines if s.startswith("error:")),
               lines[0] if lines else "rejected")
    return why[:300]


def _grammar(c: Constraint) -> str:
    """llguidance's grammar text for `c` (ValueError for what cannot even be translated)."""
    if c.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(c.value, overrides=_JSON)
    if c.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON)
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.value)
    if c.kind == "ebnf":
        # %json embeds a schema the core never sees (its keywords, its x-guidance leniency)
        if "%json" in c.value:
            raise ValueError("embedded JSON schemas (%json) are not accepted; send a "
                             "json_schema constraint")
        return llg.grammar_from("ebnf", c.value)  # GBNF (root ::= ...) or Lark (start: ...)
    # JSON string literals are Lark string literals (\", \\ and control-character escapes)
    return llg.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(x, ensure_ascii=False) for x in c.choices()))


class LLGuidanceMatcher:
    """One sequence's llguidance LLMatcher under core.contract.grammar.GrammarMatcher.

    llguidance puts a matcher that consumes a refused token into a permanent error state, so
    accept checks the token first: a refused token is False and leaves the state as it was.
    """

    def __init__(self, matcher: Any, stop: frozenset[int]):
        self.m, self.stop = matcher, stop
        self.done = False  # a stop token was accepted

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        v = bitmask[row]  # [ceil(V / 32)] int32, CPU, contiguous: written in place
        assert v.is_contiguous() and v.dtype.itemsize == 4 and v.device.type == "cpu"
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)
        if self.m.is_error():  # no way on (`start: start` has no string): llguidance then
            v.fill_(0)  # allows a stop token that accept refuses; nothing is allowed

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.done:
            return False
        if token in self.stop:
            # validate_tokens answers 0 for a stop token even where the grammar is complete
            if not self.m.is_accepting() or not self.m.consume_token(token):
                return False
            self.done = True
            return True
        return self.m.validate_tokens([token]) == 1 and self.m.consume_token(token)

    def is_terminated(self) -> bool:
        return self.done

    def jump_forward(self) -> list[int]:
        # llguidance's fast-forward tokens: forced, and in the tokenizer's canonical split
        # (it holds back a tail that a later byte could re-tokenize); the matcher is not moved
        return [] if self.done else list(self.m.compute_ff_tokens())

    def reset(self) -> None:
        self.m.reset()
        self.done = False

    def close(self) -> None:
        self.m = None


class LLGuidanceBackend:
    """Constraints -> (the grammar's text, a compiled llguidance LLMatcher never advanced) for
    this vocabulary; each sequence's matcher is a deep copy of it; the text is what crosses
    from the compile process (the matcher is rebuilt from it)."""

    name = "llguidance"

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop = tokenizer, vocab_size, list(stop_token_ids)
        self._tok: Any = None  # built on the first compile: validate needs no vocabulary

    def _text(self, c: Constraint, tok: Any = None) -> str:
        try:
            g = _grammar(c)
            err = llg.LLMatcher.validate_grammar(g, tok)
        except (ValueError, TypeError, RuntimeError) as exc:
            err = str(exc)
        if err:
            raise GrammarError(f"{c.where}: {_WHAT[c.kind]}: {_clean(err)}")
        return g

    def validate(self, constraint: Constraint) -> None:
        self._text(constraint)

    def _vocabulary(self) -> Any:
        if self._tok is None:
            eos = self.stop or None
            self._tok = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size,
                                                     eos_token=eos)
        return self._tok

    def _matcher(self, text: str, c: Constraint | None = None) -> Any:
        m = llg.LLMatcher(self._vocabulary(), text, log_level=0)
        if m.is_error():
            where = f"{c.where}: {_WHAT[c.kind]}" if c is not None else "grammar"
            raise GrammarError(f"{where}: {_clean(m.get_error())}")
        return m

    def compile(self, constraint: Constraint) -> Any:
        text = self._text(constraint, self._vocabulary())
        return text, self._matcher(text, constraint)

    def serialize(self, compiled: Any) -> bytes:
        return compiled[0].encode()

    def deserialize(self, data: bytes) -> Any:
        text = data.decode()
        return text, self._matcher(text)

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled[1].deep_copy(), frozenset(self.stop))
