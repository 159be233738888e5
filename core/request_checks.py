"""Requests validated once, at the edge (the client, before anything crosses to the worker):
tokenized, ids in the vocabulary, sampling parameters valid, the request fits the engine's
context and pool, and a structured-output constraint that the engine's grammar backend can
enforce. Each check raises ValueError naming the problem."""

from __future__ import annotations

import threading
from typing import Any

from core.admission import check_fits
from core.plan import Plan
from core.sampling import SamplingParams


class RequestChecks:
    """The client's checks for one engine: its plan (the grammar backend) and tokenizer."""

    def __init__(self, plan: Plan, tokenizer: Any):
        self.plan = plan
        self.tokenizer = tokenizer
        self._grammar: Any = None  # core.grammar.Grammar, built at the first constraint
        self._grammar_lock = threading.Lock()

    def prepare(self, prompt: str | None, input_ids: list[int] | None,
                params: SamplingParams | dict | None, info: Any
                ) -> tuple[list[int], SamplingParams]:
        """(input ids, sampling params) of a valid n = 1 request; `info` is the engine's
        core.ipc.EngineInfo (vocabulary, context, pool)."""
        p = SamplingParams.from_dict(params)
        if p.n != 1:
            raise ValueError("submit takes n = 1; expand with core.engine.expand_n first")
        if input_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            input_ids = self.tokenizer.encode(prompt)
        elif not isinstance(input_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise ValueError("input_ids must be a list of integers")
        vocab = info.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary of {vocab}")
        p.check_vocab(vocab)
        check_fits(len(input_ids), p.max_new_tokens, info.max_context, info.pool_tokens,
                   info.page_size)
        if p.constraint is not None:
            self.check_constraint(p.constraint, info)
        return input_ids, p

    def check_constraint(self, constraint: Any, info: Any) -> None:
        """Raise ValueError (core.grammar.GrammarError) naming the problem when the engine's
        grammar backend cannot enforce this constraint, or structured output is off. Checked
        here, before admission, so that the caller gets the error (the worker compiles it)."""
        name = self.plan.grammar_backend
        if name is None:
            why = next((n.split(": ", 1)[1] for n in self.plan.notes
                        if n.startswith("structured output off: ")), "no grammar backend")
            raise ValueError(f"{constraint.where}: structured output is off in this server "
                             f"({why})")
        with self._grammar_lock:
            if self._grammar is None:
                from core.grammar import make_grammar
                from core.plugins import get_registry

                self._grammar = make_grammar(get_registry(), name, self.tokenizer,
                                             info.vocab_size, list(info.eos_token_ids))
        self._grammar.check(constraint)
