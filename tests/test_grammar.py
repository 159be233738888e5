"""Grammar backends as a plugin kind: resolved by --grammar-backend, listed and explained; the
protocol on a tiny byte vocabulary (the mask allows exactly the tokens the grammar allows,
checked by brute force over the vocabulary) for every registered grammar backend; the core's
checks, cache and bitmask."""

from __future__ import annotations

import json
import types

import pytest
import torch

from core.capabilities import GrammarCaps
from core.checks import missing_packages
from core.config import ServerArgs
from core.devices import PROFILES
from core.grammar import Constraint, Grammar, GrammarError, apply_bitmask, make_grammar
from core.hookspecs import hookimpl
from core.plan import ResolveError
from core.plugins import build_registry, get_registry
from core.resolver import explain, resolve

CPU = PROFILES["xeon-amx"]
# every grammar backend registered in this environment; one whose package is missing is skipped
BACKENDS = sorted(get_registry().kind("grammar"))


def _missing_plugin():
    mod = types.ModuleType("grammar_missing")

    @hookimpl
    def core_register_grammar_backends(register):
        register("needs_missing", GrammarCaps(constraints={"regex"},
                                              requires=("definitely_not_a_package_x",),
                                              priority={"cpu": 99}), "x:y")

    mod.core_register_grammar_backends = core_register_grammar_backends
    return mod


@pytest.fixture
def registry(clean_plugin_env):
    from plugins_for_tests import builtin_backend_plugins

    import plugins.grammar.llguidance as grammar_llguidance
    import plugins.grammar.xgrammar as grammar_xgrammar

    pytest.importorskip("xgrammar")
    pytest.importorskip("llguidance")
    reg = build_registry(extra=builtin_backend_plugins() + [
        ("grammar_xgrammar", grammar_xgrammar), ("grammar_llguidance", grammar_llguidance),
        ("grammar_missing", _missing_plugin())], entry_points=False)
    assert not reg.failures, reg.failures
    return reg


# -- the resolver, the plan, the listing ----------------------------------------------------------

def test_auto_picks_the_best_installed_backend_and_explains_the_rest(model_spec, registry):
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(), registry)
    assert plan.grammar_backend == "xgrammar"  # the higher-priority one lacks its package
    why = next(c for c in plan.candidates
               if c.slot == "grammar_backend" and c.name == "needs_missing")
    assert why.reasons == ("package definitely_not_a_package_x is not installed",)
    text = explain(plan)
    assert "grammar backend    xgrammar" in text and "definitely_not_a_package_x" in text
    assert plan.to_dict()["grammar_backend"] == "xgrammar"


def test_a_named_backend_is_chosen_over_a_higher_priority_one(model_spec, registry):
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="llguidance"),
                   registry)
    assert plan.grammar_backend == "llguidance"
    assert "grammar backend    llguidance" in explain(plan)
    assert resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(),
                   registry).grammar_backend == "xgrammar"  # auto: xgrammar's priority is higher


def test_none_turns_structured_output_off(model_spec, registry):
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="none"), registry)
    assert plan.grammar_backend is None
    assert "structured output off: --grammar-backend none" in plan.notes
    assert "structured output off" in explain(plan)


def test_a_named_backend_that_cannot_run_is_an_error(model_spec, registry):
    with pytest.raises(ResolveError) as e:
        resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="needs_missing"),
                registry)
    assert "package definitely_not_a_package_x is not installed" in str(e.value)
    assert "xgrammar" in e.value.would_fit
    with pytest.raises(ResolveError, match="unknown grammar backend 'outlines'"):
        resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="outlines"),
                registry)


def test_auto_with_nothing_installed_is_off_with_the_reason(model_spec, clean_plugin_env):
    from plugins_for_tests import builtin_backend_plugins

    reg = build_registry(extra=builtin_backend_plugins() + [
        ("grammar_missing", _missing_plugin())], entry_points=False)
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(), reg)
    assert plan.grammar_backend is None
    assert any(n.startswith("structured output off: no grammar backend fits") and
               "definitely_not_a_package_x" in n for n in plan.notes)


def test_backends_lists_the_grammar_kind(capsys):
    from core.cli import main

    assert main(["backends", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plugins"]
    for name in ("xgrammar", "llguidance"):
        row = next(r for r in rows if r["kind"] == "grammar" and r["name"] == name)
        assert row["status"] == "available" and "json_schema" in row["summary"]


# -- the protocol on a tiny vocabulary ------------------------------------------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def byte_grammar(request, tmp_path_factory):
    """Each grammar backend over the byte-level test tokenizer: ids 0..255 are bytes, then the
    specials."""
    from model_fixtures import SPECIALS, write_tokenizer

    from core.tokenizer import Tokenizer

    missing = missing_packages(get_registry().get("grammar", request.param).caps.requires)
    if missing:
        pytest.skip(f"package {missing[0]} is not installed")
    path = tmp_path_factory.mktemp("bytetok")
    write_tokenizer(path)
    tok = Tokenizer.from_path(str(path))
    eos = 256 + SPECIALS.index("<|im_end|>")
    vocab = 256 + len(SPECIALS) + 5  # logits wider than the tokenizer, as models pad them
    return make_grammar(get_registry(), request.param, tok, vocab, [eos]), eos, vocab


def _allowed(grammar: Grammar, matcher) -> set[int]:
    bitmask = torch.full((1, -(-grammar.vocab_size // 32)), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, grammar.vocab_size)
    apply_bitmask(logits, bitmask, [0])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


LANGUAGES = [  # (constraint, the finite language it defines)
    (Constraint("choice", json.dumps(["apple", "apricot", "kiwi"])), {"apple", "apricot", "kiwi"}),
    (Constraint("regex", "a[bc]d?"), {"ab", "ac", "abd", "acd"}),
    (Constraint("ebnf", 'root ::= "x" ("y" | "zz")'), {"xy", "xzz"}),
    (Constraint("json_schema", json.dumps({"enum": ["on", "off"]})), {'"on"', '"off"'}),
]


@pytest.mark.parametrize("constraint,language", LANGUAGES, ids=[c.kind for c, _ in LANGUAGES])
def test_mask_allows_exactly_what_the_grammar_allows(byte_grammar, constraint, language):
    grammar, eos, vocab = byte_grammar
    for word in sorted(language):
        m = grammar.matcher(constraint)
        for i in range(len(word) + 1):
            prefix = word[:i]
            want = {ord(w[i]) for w in language if w.startswith(prefix) and len(w) > i}
            if prefix in language:
                want.add(eos)
            assert _allowed(grammar, m) == want, (word, prefix)
            if i < len(word):
                assert m.accept(ord(word[i])) and not m.is_terminated()
        assert m.accept(eos) and m.is_terminated()
        m.reset()
        assert _allowed(grammar, m) == {ord(w[0]) for w in language}
        m.close()


def test_refused_tokens_and_the_cache(byte_grammar):
    grammar, _, _ = byte_grammar
    c = Constraint("regex", "q+")
    before = grammar.compiled
    a, b = grammar.matcher(c), grammar.matcher(c)
    assert grammar.compiled == before + 1  # one compile, two independent matchers
    assert not a.accept(ord("z"))
    assert a.accept(ord("q")) and b.accept(ord("q")) and b.accept(ord("q"))


# a keyword each backend declares it cannot enforce, and how its regex parser names "a(b"
_LACKS = {"xgrammar": ("multipleOf", {"type": "integer", "multipleOf": 3}, "parenthesis"),
          "llguidance": ("contentEncoding", {"type": "string", "contentEncoding": "base64"},
                         "unclosed group")}


def test_the_core_refuses_what_the_backend_cannot_enforce(byte_grammar):
    grammar, _, _ = byte_grammar
    if grammar.name not in _LACKS:
        pytest.skip(f"no refusal expectations written for grammar backend {grammar.name}")
    keyword, sub, unclosed = _LACKS[grammar.name]
    with pytest.raises(GrammarError, match=rf"guided_json: the JSON schema uses {keyword}, "
                                           rf"which grammar backend {grammar.name} cannot "
                                           rf"enforce"):
        grammar.check(Constraint("json_schema", json.dumps(
            {"type": "object", "properties": {"n": sub}}), source="guided_json"))
    with pytest.raises(GrammarError, match="does not support structural_tag constraints"):
        grammar.check(Constraint("structural_tag", "{}"))
    with pytest.raises(GrammarError, match=rf"^regex: invalid regex: .*{unclosed}"):
        grammar.check(Constraint("regex", "a(b", source="regex"))
    with pytest.raises(GrammarError, match=r"^json_schema: invalid JSON schema: .*nonsense"):
        grammar.check(Constraint("json_schema", '{"type": "nonsense"}', source="json_schema"))
    with pytest.raises(GrammarError, match="not JSON"):
        Constraint("json_schema", "{bad").validate()


# (keyword, a schema using it, a JSON text that violates it): llguidance's schema_lacks is
# exactly those it either refuses or accepts without enforcing
_KEYWORDS = [
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, '"!!"'),
    ("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, '"{"'),
    ("not", {"not": {"type": "integer"}}, "4"),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 10}}, "4"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "3"),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, "[1,1]"),
    ("contains", {"type": "array", "contains": {"type": "string"}}, "[1]"),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b":1}'),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "4"),
    ("minimum", {"type": "integer", "minimum": 5}, "4"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 5}, "5"),
    ("pattern", {"type": "string", "pattern": "^a+$"}, '"b"'),
    ("minLength", {"type": "string", "minLength": 3}, '"ab"'),
    ("format", {"type": "string", "format": "date"}, '"x"'),
    ("minItems", {"type": "array", "minItems": 2}, "[1]"),
    ("minProperties", {"type": "object", "minProperties": 1}, "{}"),
    ("maxProperties", {"type": "object", "maxProperties": 1}, '{"a":1,"b":2}'),
    ("required", {"type": "object", "properties": {"a": {}}, "required": ["a"]}, "{}"),
    ("additionalProperties", {"type": "object", "properties": {"a": {}},
                              "additionalProperties": False}, '{"a":1,"b":2}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                           "additionalProperties": False}, '{"a":"x"}'),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
     "[1,2]"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    ("const", {"const": "a"}, '"b"'),
    ("x-guidance", {"x-guidance": {"lenient": True}, "type": "integer", "multipleOf": 3}, "4"),
]


@pytest.mark.parametrize("keyword,schema,violation", _KEYWORDS, ids=[k for k, _, _ in _KEYWORDS])
def test_llguidance_declares_exactly_the_keywords_it_cannot_enforce(byte_grammar, keyword,
                                                                   schema, violation):
    grammar, eos, _ = byte_grammar
    if grammar.name != "llguidance":
        pytest.skip("llguidance's declaration")
    c = Constraint("json_schema", json.dumps(schema))  # past the core's check, to the backend
    try:
        grammar.backend.validate(c)
        m = grammar.backend.matcher(grammar.backend.compile(c))
        loose = all(m.accept(b) for b in violation.encode()) and m.accept(eos)
        m.close()
    except GrammarError:
        loose = None  # refused by llguidance itself
    declared = keyword in grammar.caps.schema_lacks
    if loose:
        assert declared, f"{keyword} is accepted but not enforced: declare it in schema_lacks"
    elif loose is False:  # enforced: declaring it would refuse schemas for nothing
        assert not declared, f"{keyword} is enforced: take it out of schema_lacks"


def test_bitmask_masks_only_the_given_rows():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1 << 2  # token 34
    apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 34]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_constraints_cross_the_process_boundary_as_json():
    from core.ipc import AddRequest, decode, encode
    from core.sampling import SamplingParams, expand_n

    c = Constraint("regex", "a+", source="guided_regex")
    p = SamplingParams(n=2, constraint=c)
    msg = decode(encode(AddRequest("r", (1, 2), expand_n(p)[1])))
    assert msg.params.constraint == c and msg.params.n == 1
    with pytest.raises(ValueError, match="min_new_tokens together with"):
        SamplingParams.from_dict({"min_new_tokens": 2, "constraint": c.to_dict()})


def test_structured_output_off_is_refused_at_the_client():
    from core.request_checks import RequestChecks

    plan = types.SimpleNamespace(
        grammar_backend=None, notes=("structured output off: --grammar-backend none",))
    with pytest.raises(ValueError, match=r"^response_format: structured output is off in this "
                                         r"server \(--grammar-backend none\)"):
        RequestChecks(plan, tokenizer=None).check_constraint(
            Constraint("json_object", source="response_format"), info=None)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from core.config import make_server_args
    from core.loader import load_tokenizer

    return load_tokenizer(make_server_args())


@pytest.mark.parametrize("name", BACKENDS)
def test_compact_json_in_real_tokens_is_accepted_by_every_backend(name, smollm_tokenizer):
    """SmolLM2 spells `":"` as one token; a backend whose JSON grammar wants ": " (xgrammar's
    default separators) refused it while llguidance accepted it: both now write compact JSON."""
    from core.grammar import make_grammar

    missing = missing_packages(get_registry().get("grammar", name).caps.requires)
    if missing:
        pytest.skip(f"package {missing[0]} is not installed")
    tok = smollm_tokenizer
    grammar = make_grammar(get_registry(), name, tok, 49152, sorted(tok.eos_token_ids))
    text = '{"city":"Paris","population":2102650,"tags":["a","b"]}'
    for c in (Constraint("json_object", ""), Constraint("json_schema", json.dumps({
            "type": "object", "properties": {"city": {"type": "string"},
                                             "population": {"type": "integer"},
                                             "tags": {"type": "array",
                                                      "items": {"type": "string"}}},
            "required": ["city", "population", "tags"], "additionalProperties": False}))):
        m = grammar.matcher(c)
        assert all(m.accept(t) for t in tok.encode(text)), (name, c.kind)
        assert m.accept(min(tok.eos_token_ids)) and m.is_terminated()
        m.close()
