"""`outlines` grammar backend: JSON schema, JSON object, regex and choices, each turned into one
regular expression and compiled by outlines-core into a token-level DFA over the vocabulary (an
Index); a sequence's state is an outlines-core Guide. SGLang's name for it is "outlines".

Declared here without importing outlines-core; `backend.py` imports it, only when this backend
is chosen. Its priority is below xgrammar's and llguidance's, so `auto` picks those first.

No EBNF: outlines-core compiles regular languages only. A JSON schema becomes a regex through
outlines_core.json_schema; json_object is {"type": "object"} that way, so objects in it nest
three deep at most. A regex is matched whole: a leading ^ and a trailing $ are dropped, anchors
inside it are refused.

schema_lacks, found with the suite's keyword table (conformance/grammar_suite.py) against
outlines-core 0.2.14: accepted and not enforced - minimum, maximum, exclusiveMinimum,
exclusiveMaximum, multipleOf, uniqueItems, contains, minContains, maxContains,
patternProperties, propertyNames, dependentRequired, dependentSchemas, dependencies,
unevaluatedProperties, unevaluatedItems, contentEncoding, contentMediaType; enforced wrongly -
oneOf (run as anyOf), pattern (pasted into the string unescaped: "." matches a quote; dropped
beside minLength / maxLength), format (date and uri take any Unicode digit, date-time
no offset, time's fraction wants a backslash); refused by outlines-core itself - not, if, then,
else. What its translation drops only in some places (a keyword beside another that it reads
instead, allOf of several schemas, recursive $refs, names it does not escape) the backend's
validate refuses, naming it (schema.py).
"""

from core.contract.capabilities import DEVICE_TYPES, GrammarCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.7,<2"

CAPS = GrammarCaps(
    constraints={"json_schema", "json_object", "regex", "choice"},
    schema_lacks={
        # accepted, not enforced
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "uniqueItems", "contains", "minContains", "maxContains", "patternProperties",
        "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
        "unevaluatedProperties", "unevaluatedItems", "contentEncoding", "contentMediaType",
        # enforced wrongly
        "oneOf", "pattern", "format",
        # refused by outlines-core itself
        "not", "if", "then", "else"},
    tokenizers={"hf"},
    serialize=True,
    requires=("outlines_core",),
    priority={d: 5 for d in DEVICE_TYPES},
    description="outlines: regular expressions compiled into a token-level DFA (outlines-core)",
)


@hookimpl
def core_register_grammar_backends(register):
    register("outlines", CAPS, "plugins.grammar.outlines.backend:OutlinesBackend")
