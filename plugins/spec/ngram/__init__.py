"""The `ngram` proposer (prompt lookup decoding): drafts the tokens that followed the latest
earlier occurrence of the request's last n tokens, in its prompt or its output so far.
Pure Python and numpy on the host; registered like any third-party proposer."""

from __future__ import annotations

from core.contract.capabilities import SpecCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.9,<2"

CAPS = SpecCaps(
    devices=("*",), draft_shapes=("chain",), max_draft_tokens=16, needs_draft_weights=False,
    graph_safe=False, grammars=False, tensor_parallel=False,
    requires=("numpy",),
    description="prompt lookup: the continuation of the latest earlier match of the last "
                "min..max tokens (host, numpy)")


@hookimpl
def core_register_spec_proposers(register):
    register("ngram", CAPS, "plugins.spec.ngram.proposer:NgramProposer")
