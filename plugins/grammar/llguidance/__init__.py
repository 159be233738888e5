"""`llguidance` grammar backend: JSON schema, JSON object, regex, EBNF (GBNF or Lark) and
choices, compiled by llguidance (an Earley parser over a lazy lexer, masks computed per step)
into a token-mask matcher (the core applies its bitmask to the logits).

Declared here without importing llguidance; `backend.py` imports it, only when this backend is
chosen. Its priority is below xgrammar's, so `auto` picks xgrammar when both are installed.

schema_lacks, checked against llguidance 1.9's matcher (tests/test_grammar.py): contentEncoding
and contentMediaType are accepted without being enforced; the rest llguidance itself refuses
("Unimplemented keys", oneOf unless coerced to anyOf, which would be loose). Declaring those too
makes the refusal the core's, naming the keyword, and puts it in the support matrix.
"""

from core.contract.capabilities import DEVICE_TYPES, GrammarCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.7,<2"

CAPS = GrammarCaps(
    constraints={"json_schema", "json_object", "regex", "ebnf", "choice"},
    schema_lacks={"contentEncoding", "contentMediaType",  # accepted, not enforced
                  # refused by llguidance itself (lenient off)
                  "not", "if", "then", "else", "oneOf", "dependentSchemas", "dependentRequired",
                  "dependencies", "uniqueItems", "contains", "minContains", "maxContains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef"},
    tokenizers={"hf"},
    serialize=True,
    jump_forward=True,
    requires=("llguidance",),
    priority={d: 10 for d in DEVICE_TYPES},
    description="llguidance: Earley parser with a lazy lexer, token masks computed on the fly",
)


@hookimpl
def core_register_grammar_backends(register):
    register("llguidance", CAPS, "plugins.grammar.llguidance.backend:LLGuidanceBackend")
