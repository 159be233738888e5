"""Requests validated once, at the edge (the client, before anything crosses to the worker):
tokenized, ids in the vocabulary, sampling parameters valid, the request fits the engine's
context and pool, and a structured-output constraint that the engine's grammar backend can
enforce. Each check raises ValueError naming the problem."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.contract.grammar import check_constraint
from core.engine.scheduler import check_fits
from core.messages import SamplingParams
from core.plan.plan import Plan
from core.plan.registry import get_registry

if TYPE_CHECKING:
    from core.contract.grammar import Constraint
    from core.messages import EngineInfo
    from core.tokenizer import Tokenizer

# what turns structured output on after the quick start (pyproject.toml's `grammar` extra)
GRAMMAR_EXTRA_HINT = ("install a grammar backend: pip install 'core-serve[grammar]' (from a clone: "
                      "pip install -e '.[grammar]'), then restart the server")


class RequestChecks:
    """The client's checks for one engine: its plan (the grammar backend) and tokenizer."""

    def __init__(self, plan: Plan, tokenizer: Tokenizer):
        self.plan = plan
        self.tokenizer = tokenizer

    def prepare(self, prompt: str | None, input_ids: list[int] | None,
                params: SamplingParams | dict | None, info: EngineInfo
                ) -> tuple[list[int], SamplingParams]:
        """(input ids, sampling params) of a valid n = 1 request; `info` is the engine's
        core.messages.EngineInfo (vocabulary, context, pool)."""
        p = SamplingParams.from_dict(params)
        if p.n != 1:
            raise ValueError("submit takes n = 1; expand with core.frontend.offline.expand_n first")
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

    def check_constraint(self, constraint: Constraint, info: EngineInfo) -> None:
        """Raise ValueError (core.contract.grammar.GrammarError) naming the problem when the engine's
        grammar backend cannot enforce this constraint (its shape, the size limits, what the
        backend declares), or structured output is off. Checked here, before admission, so
        that the caller gets the error. No grammar library runs in this process (it carries
        every client's requests): the worker compiles the constraint in a compile process,
        and what only the library finds wrong is the request's 400 from there."""
        name = self.plan.grammar_backend
        if name is None:
            why = next((n.split(": ", 1)[1] for n in self.plan.notes
                        if n.startswith("structured output off: ")), "no grammar backend")
            hint = "" if why.startswith("--grammar-backend") else (
                f"; {GRAMMAR_EXTRA_HINT}")  # no grammar library installed (the quick start's)
            raise ValueError(f"{constraint.where}: structured output is off in this server "
                             f"({why}){hint}")
        reg = get_registry().get("grammar", name)
        if reg is None:
            raise ValueError(f"{constraint.where}: grammar backend {name} is not registered "
                             f"in this process")
        check_constraint(constraint, name, reg.caps)
