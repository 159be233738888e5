"""The `suffix` proposer (after SuffixDecoding, Oliaro et al. 2024): drafts from the longest
match of a request's latest tokens in two indexes, the request's own prompt and output, and a
bounded cache of earlier requests' outputs, so repeated agentic / tool-calling work drafts from
what was answered before. Pure Python on the host; registered like any third-party proposer.
SGLang's and vLLM's name for it is `suffix` (vLLM's `suffix_decoding` is an alias here)."""

from __future__ import annotations

from core.contract.capabilities import SpecCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.9,<2"

CAPS = SpecCaps(
    devices=("*",), draft_shapes=("chain",), max_draft_tokens=16, needs_draft_weights=False,
    graph_safe=False, grammars=False, tensor_parallel=False, aliases=("suffix_decoding",),
    description="suffix match over the request and a bounded cache of earlier outputs; the "
                "most frequent continuation, drafts cut where it gets unlikely (host)")


@hookimpl
def core_register_spec_proposers(register):
    register("suffix", CAPS, "plugins.spec.suffix.proposer:SuffixProposer")
