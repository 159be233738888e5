"""The `standalone` proposer (SGLang's STANDALONE, vLLM's `draft_model`): a smaller model that
shares the target's tokenizer drafts k tokens greedily per request and step. The engine loads
the draft (--speculative-draft-model-path, its own load format and quantization) and runs it
with a KV pool of its own; this plugin only keeps the draft in step with each request, through
SpecConfig.draft (core.contract.spec.DraftModel). Registered like any third-party proposer."""

from __future__ import annotations

from core.contract.capabilities import SpecCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.11,<2"

CAPS = SpecCaps(
    devices=("*",), draft_shapes=("chain",), max_draft_tokens=16, needs_draft_weights=True,
    graph_safe=False, grammars=False, tensor_parallel=False,
    aliases=("draft_model",),
    description="a draft model sharing the target's tokenizer, run by the engine with its own "
                "KV pool; k greedy drafts per request and step")


@hookimpl
def core_register_spec_proposers(register):
    register("standalone", CAPS, "plugins.spec.draft_model.proposer:DraftModelProposer")
