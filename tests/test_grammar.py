"""Grammar backends as a plugin kind: resolved by --grammar-backend, listed and explained; the
grammar conformance suite (conformance/grammar_suite.py) over every built-in backend, and shown
to fail backends that are wrong; what the suite cannot know: the core's checks and bitmask,
each backend's own declarations and refusals, real tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
import torch

from conformance import grammar_suite
from conformance.grammar_suite import *  # noqa: F401,F403 - the suite, over every built-in
from conformance.grammar_suite import (
    CASES,
    KEYWORDS,
    check_case,
    check_keyword,
    check_protocol,
    keyword_status,
    suite_grammar,
    suite_vocab,
)
from core.contract.capabilities import GrammarCaps
from core.contract.grammar import Constraint, Grammar, GrammarError, apply_bitmask
from core.contract.hookspecs import hookimpl
from core.plan.args import ServerArgs
from core.plan.checks import missing_packages
from core.plan.devices import PROFILES
from core.plan.plan import ResolveError
from core.plan.registry import build_registry, get_registry
from core.plan.resolver import explain, resolve

CPU = PROFILES["xeon-amx"]
BUILT_IN = ("xgrammar", "llguidance", "outlines")
# every grammar backend registered in this environment; one whose package is missing is skipped
BACKENDS = sorted(get_registry().kind("grammar"))

# What the suite finds wrong in a built-in backend: strict xfails (each fails the run once the
# plugin is fixed, so that its line here goes too). xgrammar 0.2.9's loose schema combinations
# are refused by its plugin's validate, its special tokens blanked, and raw control bytes
# masked for JSON; what is left is narrower than the schema, never looser:
KNOWN = {"xgrammar-json_schema-short-string": "xgrammar 0.2.9 allows no escape (\\n, \\u..) in "
         "a string with maxLength / minLength: valid text refused, never invalid text allowed"}


def pytest_generate_tests(metafunc):
    grammar_suite.parametrize(metafunc, KNOWN)


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
    import plugins.grammar.outlines as grammar_outlines
    import plugins.grammar.xgrammar as grammar_xgrammar

    for package in ("xgrammar", "llguidance", "outlines_core"):
        pytest.importorskip(package)
    reg = build_registry(extra=builtin_backend_plugins() + [
        ("grammar_xgrammar", grammar_xgrammar), ("grammar_llguidance", grammar_llguidance),
        ("grammar_outlines", grammar_outlines), ("grammar_missing", _missing_plugin())],
        entry_points=False)
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


@pytest.mark.parametrize("name", ["llguidance", "outlines"])
def test_a_named_backend_is_chosen_over_a_higher_priority_one(model_spec, registry, name):
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend=name), registry)
    assert plan.grammar_backend == name
    assert f"grammar backend    {name}" in explain(plan)
    assert resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(),
                   registry).grammar_backend == "xgrammar"  # auto: xgrammar's priority is higher


def test_none_turns_structured_output_off(model_spec, registry):
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="none"), registry)
    assert plan.grammar_backend is None
    assert "structured output off: --grammar-backend none" in plan.notes
    assert "structured output off" in explain(plan)


def test_jump_forward_needs_a_backend_that_can_jump(model_spec, registry):
    """--enable-jump-forward has its effect (the plan says so) or is refused with the reason:
    never dropped, nor bought by turning structured output off."""
    spec = model_spec("llama-3.1-8b")
    plan = resolve(spec, CPU, ServerArgs(enable_jump_forward=True), registry)
    assert plan.grammar_backend == "xgrammar"
    assert any(n.startswith("jump-forward on") for n in plan.notes), plan.notes
    assert not any(n.startswith("jump-forward") for n in resolve(
        spec, CPU, ServerArgs(), registry).notes)
    with pytest.raises(ResolveError) as e:
        resolve(spec, CPU, ServerArgs(grammar_backend="outlines", enable_jump_forward=True),
                registry)
    assert "cannot jump forward (--enable-jump-forward)" in str(e.value)
    with pytest.raises(ResolveError, match="--grammar-backend none turns off"):
        resolve(spec, CPU, ServerArgs(grammar_backend="none", enable_jump_forward=True),
                registry)


def test_a_named_backend_that_cannot_run_is_an_error(model_spec, registry):
    with pytest.raises(ResolveError) as e:
        resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="needs_missing"),
                registry)
    assert "package definitely_not_a_package_x is not installed" in str(e.value)
    assert "xgrammar" in e.value.would_fit
    with pytest.raises(ResolveError, match="unknown grammar backend 'guidance'"):
        resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="guidance"),
                registry)


def test_outlines_without_outlines_core_is_a_rejection_reason(model_spec, registry,
                                                               monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "outlines_core" else find_spec(name, *a))
    with pytest.raises(ResolveError, match="package outlines_core is not installed"):
        resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(grammar_backend="outlines"),
                registry)
    plan = resolve(model_spec("llama-3.1-8b"), CPU, ServerArgs(), registry)
    why = next(c for c in plan.candidates if c.slot == "grammar_backend" and c.name == "outlines")
    assert why.reasons == ("package outlines_core is not installed",)


def test_grammar_plugins_import_no_grammar_library_until_chosen():
    code = ("import sys; import plugins.grammar.xgrammar, plugins.grammar.llguidance, "
            "plugins.grammar.outlines; "
            "print(sorted(m for m in ('xgrammar', 'llguidance', 'outlines_core') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


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
    for name in BUILT_IN:
        row = next(r for r in rows if r["kind"] == "grammar" and r["name"] == name)
        assert row["status"] == "available" and "json_schema" in row["summary"]
    outlines = next(r for r in rows if r["kind"] == "grammar" and r["name"] == "outlines")
    assert "ebnf" not in outlines["summary"] and "minimum" in outlines["summary"]


# -- the suite itself -----------------------------------------------------------------------------

def test_the_suite_covers_every_built_in_backend_and_declared_type():
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)  # no option
    ids = {p.id for p in grammar_suite.grammar_params(unnamed, "case")}
    for name in BUILT_IN:
        if missing_packages(get_registry().get("grammar", name).caps.requires):
            continue
        kinds = get_registry().get("grammar", name).caps.constraints
        for case in CASES:
            assert (f"{name}-{case.id}" in ids) == (case.constraint.kind in kinds), case.id
    assert not any(i.startswith("outlines-ebnf") for i in ids)  # not declared: not collected


def _reference() -> Grammar:
    """A built-in backend the whole suite passes (the wrong backends below wrap it)."""
    for name in ("llguidance", "outlines"):
        if not missing_packages(get_registry().get("grammar", name).caps.requires):
            return suite_grammar(name)
    pytest.skip("neither llguidance nor outlines-core is installed")


class _Wrapped:
    """A matcher that delegates to a real one, then spoils the mask or accept."""

    def __init__(self, m, spoil):
        self.m, self.spoil = m, spoil

    def fill_bitmask(self, bitmask, row):
        self.m.fill_bitmask(bitmask, row)
        self.spoil(self, bitmask[row])

    def __getattr__(self, name):
        return getattr(self.m, name)


def _wrong(grammar: Grammar, *, spoil=None, accept=None, caps=None, schema=None) -> Grammar:
    base = grammar.backend

    class Backend:
        def validate(self, c):
            base.validate(schema(c) if schema else c)

        def compile(self, c):
            return base.compile(schema(c) if schema else c)

        def matcher(self, compiled):
            m = _Wrapped(base.matcher(compiled), spoil or (lambda w, row: None))
            if accept is not None:
                m.accept = lambda t: accept(m.m, t)
            return m

    return Grammar("wrong", caps or grammar.caps, Backend(), grammar.vocab_size)


def _set(token):
    def spoil(w, row):
        row[token // 32] |= 1 << (token % 32)
    return spoil


def _clear_multibyte():
    """Clear the first multi-byte token the mask allows."""
    def spoil(w, row):
        bits = row.tolist()
        for t in sorted(suite_vocab().bytes_of):
            if t >= 256 and (bits[t // 32] >> (t % 32)) & 1:
                row[t // 32] &= ~(1 << (t % 32))
                return
    return spoil


@pytest.mark.parametrize("how", ["an extra token", "a control token", "a missing token",
                                 "accept takes anything", "no termination"])
def test_the_suite_fails_a_wrong_mask_or_matcher(how):
    grammar = _reference()
    v = suite_vocab()
    case = next(c for c in CASES if c.id == "choice-fruits")
    check_case(grammar, case)  # the real backend passes
    wrong = {
        "an extra token": dict(spoil=_set(ord("z"))),
        "a control token": dict(spoil=_set(min(v.never))),
        "a missing token": dict(spoil=_clear_multibyte()),
        "accept takes anything": dict(accept=lambda m, t: m.accept(t) or True),
        "no termination": dict(accept=lambda m, t: m.accept(t) if t not in v.stops else True),
    }[how]
    with pytest.raises(AssertionError):
        check_case(_wrong(grammar, **wrong), case)


def test_the_suite_fails_a_backend_that_ignores_a_keyword_it_does_not_declare():
    grammar = _reference()
    row = next(k for k in KEYWORDS if k.id == "maxLength")
    check_keyword(grammar, row)

    def drop_max_length(c):
        s = c.schema()
        s.pop("maxLength", None)
        return Constraint(c.kind, json.dumps(s), c.source)

    with pytest.raises(AssertionError, match="accepts .* against maxLength"):
        check_keyword(_wrong(grammar, schema=drop_max_length), row)
    # declared: then the core refuses it, and the suite checks that it does
    lacks = GrammarCaps(constraints=grammar.caps.constraints,
                        schema_lacks=grammar.caps.schema_lacks | {"maxLength"})
    check_keyword(_wrong(grammar, schema=drop_max_length, caps=lacks), row)


def test_the_suite_fails_rows_bitmask_and_messages():
    grammar = _reference()
    check_protocol(grammar, "rows")

    class Spill(_Wrapped):  # writes the next row too
        def fill_bitmask(self, bitmask, row):
            self.m.fill_bitmask(bitmask, row)
            if row + 1 < bitmask.shape[0]:
                bitmask[row + 1] = -1

    wrong = _wrong(grammar)
    wrong.backend.matcher = lambda compiled: Spill(grammar.backend.matcher(compiled), None)
    with pytest.raises(AssertionError, match="outside its row"):
        check_protocol(wrong, "rows")

    class Mute:
        def validate(self, c):
            try:
                grammar.backend.validate(c)
            except GrammarError:
                raise GrammarError("bad") from None

        def compile(self, c):
            return grammar.backend.compile(c)

        def matcher(self, compiled):
            return grammar.backend.matcher(compiled)

    with pytest.raises(AssertionError, match="must name the request field"):
        check_protocol(Grammar("mute", grammar.caps, Mute(), grammar.vocab_size), "invalid")


def test_the_suite_fails_a_backend_whose_serialized_grammar_comes_back_different():
    grammar = _reference()
    check_protocol(grammar, "serialize")
    base = grammar.backend
    other = next(c.constraint for c in CASES if c.constraint.kind in grammar.caps.constraints
                 and c.constraint.kind != "json_object")

    class Forgetful:  # sends back another constraint's grammar
        def validate(self, c):
            base.validate(c)

        def compile(self, c):
            return base.compile(c)

        def serialize(self, compiled):
            return base.serialize(base.compile(other))

        def deserialize(self, data):
            return base.deserialize(data)

        def matcher(self, compiled):
            return base.matcher(compiled)

    wrong = Grammar("forgetful", grammar.caps, Forgetful(), grammar.vocab_size)
    with pytest.raises(AssertionError, match="deserialized grammar allows other tokens"):
        check_protocol(wrong, "serialize")


# -- declarations and refusals the suite does not decide ------------------------------------------

def _declared() -> list:
    """(backend, keyword) for each keyword of the suite's table a built-in declares lacking."""
    out = []
    for name in BUILT_IN:
        reg = get_registry().get("grammar", name)
        if reg is not None and not missing_packages(reg.caps.requires):
            out += [(name, k) for k in sorted({k.keyword for k in KEYWORDS})
                    if k in reg.caps.schema_lacks]
    return out


# declared though enforced: declaring it refuses schemas for nothing
KNOWN_OVER: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("name,keyword", [
    pytest.param(n, k, marks=[pytest.mark.xfail(reason=KNOWN_OVER[n, k], strict=True)]
                 if (n, k) in KNOWN_OVER else []) for n, k in _declared()])
def test_a_declared_keyword_is_one_the_backend_does_not_enforce(name, keyword):
    """schema_lacks lists only keywords the backend refuses or runs loosely in some row of the
    suite's table (the suite checks the converse)."""
    grammar = suite_grammar(name)
    statuses = {keyword_status(grammar, k) for k in KEYWORDS if k.keyword == keyword}
    assert statuses != {"enforced"}, \
        f"{name} enforces {keyword} in every row: take it out of schema_lacks"


def test_llguidance_ignores_a_schema_asking_for_leniency():
    if missing_packages(("llguidance",)):
        pytest.skip("llguidance is not installed")
    grammar = suite_grammar("llguidance")
    c = Constraint("json_schema", json.dumps(
        {"x-guidance": {"lenient": True}, "type": "integer", "multipleOf": 3}))
    m = grammar.matcher(c)  # the backend's overrides win over the schema's own x-guidance
    assert not (m.accept(ord("4")) and m.accept(suite_vocab().stops[0]))


def test_the_core_refuses_what_a_backend_does_not_declare():
    grammar = _reference()
    core = Grammar(grammar.name, GrammarCaps(constraints={"regex", "json_schema"},
                                             schema_lacks={"multipleOf"}),
                   grammar.backend, grammar.vocab_size)
    with pytest.raises(GrammarError, match=rf"^guided_json: the JSON schema uses multipleOf, "
                                           rf"which grammar backend {grammar.name} cannot "
                                           rf"enforce"):
        core.check(Constraint("json_schema", json.dumps(
            {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}),
            source="guided_json"))
    with pytest.raises(GrammarError, match=r"does not support choice constraints \(supports "
                                           r"json_schema, regex\)"):
        core.check(Constraint("choice", '["a"]'))
    with pytest.raises(GrammarError, match="not JSON"):
        Constraint("json_schema", "{bad").validate()


@pytest.mark.parametrize("regex,ok", [("^a+$", True), ("^(a|b)c$", True), (r"a\$", True),
                                      ("a$b", False), (r"\bword", False), ("a|^b", False)])
def test_outlines_matches_a_whole_text_and_refuses_inner_anchors(regex, ok):
    if missing_packages(("outlines_core",)):
        pytest.skip("outlines-core is not installed")
    grammar = suite_grammar("outlines")
    c = Constraint("regex", regex, source="regex")
    if not ok:
        with pytest.raises(GrammarError, match="^regex: invalid regex: anchors and word "
                                               "boundaries"):
            grammar.check(c)
        return
    m = grammar.matcher(c)
    text = {"^a+$": b"aa", "^(a|b)c$": b"bc", r"a\$": b"a$"}[regex]
    assert all(m.accept(b) for b in text) and m.accept(suite_vocab().stops[0])


@pytest.mark.parametrize("schema,words", [
    ({"type": "integer", "anyOf": [{"type": "string"}]}, "uses type beside anyOf"),
    ({"allOf": [{"type": "integer"}, {"type": "integer"}]}, "uses allOf of 2 schemas"),
    ({"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}}},
      "$ref": "#/$defs/n"}, "uses a recursive $ref"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 2.0}}},
     "uses minLength written as a float"),
])
def test_outlines_names_what_its_translation_would_drop(schema, words):
    if missing_packages(("outlines_core",)):
        pytest.skip("outlines-core is not installed")
    with pytest.raises(GrammarError, match=rf"^guided_json: the JSON schema {re.escape(words)}"
                                           rf".* which grammar backend outlines cannot enforce"):
        suite_grammar("outlines").check(Constraint("json_schema", json.dumps(schema),
                                                   source="guided_json"))
    with pytest.raises(GrammarError, match=r"^guided_json: invalid JSON schema: minLength must "
                                           r"be a non-negative integer \(at /properties/a\)"):
        suite_grammar("outlines").check(Constraint("json_schema", json.dumps(
            {"type": "object", "properties": {"a": {"type": "string", "minLength": 1.5}}}),
            source="guided_json"))


# -- the core's bitmask and the process boundary --------------------------------------------------

def test_bitmask_masks_only_the_given_rows():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1 << 2  # token 34
    apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 34]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_constraints_cross_the_process_boundary_as_json():
    from core.engine.sampling import SamplingParams, expand_n
    from core.messages import AddRequest, decode, encode

    c = Constraint("regex", "a+", source="guided_regex")
    p = SamplingParams(n=2, constraint=c)
    msg = decode(encode(AddRequest("r", (1, 2), expand_n(p)[1])))
    assert msg.params.constraint == c and msg.params.n == 1
    with pytest.raises(ValueError, match="min_new_tokens together with"):
        SamplingParams.from_dict({"min_new_tokens": 2, "constraint": c.to_dict()})


def test_structured_output_off_is_refused_at_the_client():
    from core.frontend.request_checks import RequestChecks

    plan = types.SimpleNamespace(
        grammar_backend=None, notes=("structured output off: --grammar-backend none",))
    with pytest.raises(ValueError, match=r"^response_format: structured output is off in this "
                                         r"server \(--grammar-backend none\)"):
        RequestChecks(plan, tokenizer=None).check_constraint(
            Constraint("json_object", source="response_format"), info=None)


# -- real tokens ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_tokenizer():
    from core.engine.loader import load_tokenizer
    from core.plan.args import make_server_args

    return load_tokenizer(make_server_args())


@pytest.mark.parametrize("name", BACKENDS)
def test_compact_json_in_real_tokens_is_accepted_by_every_backend(name, smollm_tokenizer):
    """SmolLM2 spells `":"` as one token; a backend whose JSON grammar wants ": " (xgrammar's
    default separators) refused it while llguidance accepted it: all now write compact JSON."""
    from core.contract.grammar import make_grammar

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


def test_a_backend_that_crashes_on_compile_is_a_500_for_that_request_only():
    """A library raising something other than a refusal (a version mismatch: llguidance 1.6
    under code written for 1.9 raised TypeError) fails the one request with status 500,
    naming the backend; it is not the engine's death (the worker maps `status`)."""
    from core.contract.grammar import GrammarBackendError

    class Crashing:
        def validate(self, c):
            pass

        def compile(self, c):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted")

    g = Grammar("crashy", GrammarCaps(constraints=frozenset({"json_object", "regex"})),
                Crashing(), 64)
    with pytest.raises(GrammarBackendError) as info:
        g.compiled_for(Constraint("regex", "a+"))
    assert info.value.status == 500 and isinstance(info.value, GrammarError)
    assert "grammar backend crashy failed to compile the regex constraint: TypeError" in str(
        info.value)

    class Refusing(Crashing):
        def compile(self, c):
            raise GrammarError("regex: unsupported look-behind")

    with pytest.raises(GrammarError) as info:  # a refusal stays a refusal (400)
        Grammar("strict", GrammarCaps(constraints=frozenset({"regex"})), Refusing(),
                64).compiled_for(Constraint("regex", "(?<=a)b"))
    assert getattr(info.value, "status", 400) == 400


def test_a_grammar_that_allows_no_first_token_is_refused_at_compile(smollm_tokenizer):
    """A grammar that can never finish because it allows no token at all at its start
    (xgrammar and llguidance on `root ::= root`; outlines on a regex of a NUL) is a GrammarError (a 400 naming
    the constraint) when it compiles; it was compiled, and its request sampled a token the
    grammar refused and ended as a 200 with finish_reason "abort" and no message."""
    class Nothing:
        def validate(self, c):
            pass

        def compile(self, c):
            return "compiled"

        def matcher(self, compiled):
            return types.SimpleNamespace(fill_bitmask=lambda bitmask, row: None,
                                         close=lambda: None)

    g = Grammar("none-allowed", GrammarCaps(constraints=frozenset({"regex"})), Nothing(), 64)
    with pytest.raises(GrammarError) as info:
        g.compiled_for(Constraint("regex", "a+", source="regex"))
    assert getattr(info.value, "status", 400) == 400
    assert str(info.value).startswith("regex: the constraint can never be satisfied: its "
                                       "grammar allows no token"), str(info.value)
    from core.contract.grammar import make_grammar

    cases = [("xgrammar", Constraint("ebnf", "root ::= root", source="ebnf")),
             ("llguidance", Constraint("ebnf", "root ::= root", source="ebnf")),
             ("outlines", Constraint("regex", "\x00", source="regex"))]
    for name, c in cases:
        if missing_packages(get_registry().get("grammar", name).caps.requires):
            continue
        tok = smollm_tokenizer
        grammar = make_grammar(get_registry(), name, tok, 49152, sorted(tok.eos_token_ids))
        with pytest.raises(GrammarError, match="can never be satisfied"):
            grammar.compile(c)
        grammar.compile(Constraint(c.kind, 'root ::= "a"' if c.kind == "ebnf" else "a"))


def test_xgrammar_structural_tag_enforces_the_schema_after_its_trigger(smollm_tokenizer):
    """Free text until the trigger; then only the structure's JSON, then its end; then free
    text again (a deterministic walk on the embedded model's tokenizer)."""
    pytest.importorskip("xgrammar")
    from core.contract.grammar import make_grammar

    tok, vocab = smollm_tokenizer, 49152
    g = make_grammar(get_registry(), "xgrammar", tok, vocab, sorted(tok.eos_token_ids))
    tag = json.dumps({"triggers": ["<f>"], "structures": [{"begin": "<f>", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}, "end": "</f>"}]})
    m = g.matcher(Constraint("structural_tag", tag))

    def feed(text: str) -> bool:
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert feed("Sure, calling it: ")
    assert feed("<f>")
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    allowed = [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    texts = [tok.decode([t]) for t in allowed]
    assert texts and all(x.lstrip(" \t\n\r")[:1] in ("{", "") for x in texts), texts[:20]
    assert not any(x.startswith("hello") for x in texts)
    assert feed('{"a": 12}</f>')
    assert feed(" and more free text")
    m2 = g.matcher(Constraint("structural_tag", tag))
    ids = tok.encode('x <f>{"b": 1}', add_special_tokens=False)
    assert not all(m2.accept(t) for t in ids)  # "b" is no property of the schema


def test_a_lazy_backend_that_cannot_be_built_is_a_500_not_the_engine_s_death():
    """The worker builds its backend lazily (off the start's path): a library that fails then
    fails the constrained request with status 500, each time, and nothing else."""
    from core.contract.grammar import GrammarBackendError

    calls = []

    def broken():
        calls.append(1)
        raise ImportError("libxgrammar.so: cannot open shared object file")

    g = Grammar("broken", GrammarCaps(constraints=frozenset({"regex"})), None, 64, build=broken)
    g.prepare()  # in the background: its failure is not raised there
    for _ in range(2):
        with pytest.raises(GrammarBackendError) as info:
            g.check(Constraint("regex", "a+"))
        assert info.value.status == 500 and "could not be built: ImportError" in str(info.value)
    assert len(calls) >= 2  # tried again at each request, not remembered as built
