"""The xgrammar backend (core.grammar.GrammarBackend); imported only when it is chosen."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from core.grammar import Constraint, GrammarError

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and "Check failed: ...: ")
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_WHAT = {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
         "regex": "invalid regex", "ebnf": "invalid EBNF grammar", "choice": "invalid choices",
         "structural_tag": "invalid structural tag"}


def _clean(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).strip().splitlines()[0][:300]


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are EBNF string escapes for \", \\ and control characters
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


COMPACT = (",", ":")  # JSON item and key separators


class XGrammarMatcher:
    """One sequence's xgrammar GrammarMatcher under core.grammar.GrammarMatcher."""

    def __init__(self, matcher: Any):
        self.m = matcher

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def jump_forward(self) -> list[int]:
        # greedy longest tokens over the forced text, the last one dropped where a longer
        # token extends it; no stop or special tokens; the matcher is not moved
        return list(self.m.find_jump_forward_tokens())

    def reset(self) -> None:
        self.m.reset()

    def close(self) -> None:
        self.m = None


class XGrammarBackend:
    """Constraints -> xgrammar CompiledGrammar for this tokenizer's vocabulary."""

    name = "xgrammar"

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: Any = None  # built on the first compile: validate needs no vocabulary

    def _grammar(self, c: Constraint, compiler: Any = None) -> Any:
        """xgrammar's Grammar (no compiler) or CompiledGrammar for `c`; JSON without free
        whitespace (small models loop on it) and compact separators, as the llguidance backend
        writes it (xgrammar's own default would demand ", " and ": "), strict objects for
        schemas as OpenAI's strict."""
        x = compiler or xgr.Grammar
        if c.kind == "json_schema":
            fn = x.compile_json_schema if compiler else x.from_json_schema
            return fn(c.value, any_whitespace=False, separators=COMPACT, strict_mode=True)
        if c.kind == "json_object":
            fn = x.compile_json_schema if compiler else x.from_json_schema
            return fn('{"type": "object"}', any_whitespace=False, separators=COMPACT,
                      strict_mode=False)
        if c.kind == "regex":
            return (x.compile_regex if compiler else x.from_regex)(c.value)
        if c.kind == "structural_tag":  # SGLang's / vLLM's shape: structures + triggers
            tag = json.loads(c.value)
            items = [xgr.StructuralTagItem(begin=t["begin"], schema=json.dumps(t["schema"]),
                                           end=t["end"]) for t in tag["structures"]]
            fn = x.compile_structural_tag if compiler else x.from_structural_tag
            return fn(items, list(tag["triggers"]))
        text = c.value if c.kind == "ebnf" else _choice_ebnf(c.choices())
        return (x.compile_grammar if compiler else x.from_ebnf)(text)

    def validate(self, constraint: Constraint) -> None:
        try:
            self._grammar(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{constraint.where}: {_WHAT[constraint.kind]}: "
                               f"{_clean(exc)}") from None

    def compile(self, constraint: Constraint) -> Any:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.hf,
                                                      vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        try:
            return self._grammar(constraint, self._compiler)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{constraint.where}: {_WHAT[constraint.kind]}: "
                               f"{_clean(exc)}") from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))
