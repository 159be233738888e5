"""`xgrammar` grammar backend: JSON schema, JSON object, regex, EBNF and choices, compiled by
xgrammar into a token-mask matcher (the core applies its bitmask to the logits).

Declared here without importing xgrammar; `backend.py` imports it, only when this backend is
chosen. schema_lacks lists the JSON-schema keywords xgrammar 0.2 accepts without enforcing
(checked against its matcher): a schema using one is refused rather than run loosely; the
combinations it runs loosely (anyOf / enum / const / $ref beside other keywords, allOf of
several schemas, required names outside properties) are refused by its validate.
"""

from core.contract.capabilities import DEVICE_TYPES, GrammarCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.7,<2"

CAPS = GrammarCaps(
    constraints={"json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag"},
    # uniqueItems .. oneOf: found accepted and not enforced by the grammar conformance suite
    # (conformance/grammar_suite.py; oneOf runs as anyOf)
    schema_lacks={"not", "if", "then", "else", "contentEncoding",
                  "contentMediaType", "dependentSchemas", "uniqueItems", "contains",
                  "propertyNames", "dependentRequired", "oneOf"},
    tokenizers={"hf"},
    serialize=True,
    jump_forward=True,
    requires=("xgrammar",),
    priority={d: 20 for d in DEVICE_TYPES},
    description="xgrammar: pushdown-automaton grammars with a precomputed token-mask cache",
)


@hookimpl
def core_register_grammar_backends(register):
    register("xgrammar", CAPS, "plugins.grammar.xgrammar.backend:XGrammarBackend")
