"""Structured output through the real server on SmolLM2, one server per grammar backend
(xgrammar, the default, outlines, and llguidance with jump-forward on), with the official
`openai` client: JSON schema / JSON
object / regex / choice outputs follow their constraint, streaming too; invalid constraints, a
keyword or a type the backend cannot enforce and two constraints are 400s naming the problem.
The fake engine (no grammar backend) refuses every constraint instead of ignoring it."""

from __future__ import annotations

import json
import re

import openai
import pytest

from conformance.server_kit import FakeEngine, ServerThread, http_request
from core.plan.args import ServerArgs

jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-grammar"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
AGE_RANGE = {"minimum": 0, "maximum": 120}
# server: (backend, its package, jump-forward)
BACKENDS = {"xgrammar": ("xgrammar", "xgrammar", False),
            "outlines": ("outlines", "outlines_core", False),
            "llguidance-jump": ("llguidance", "llguidance", True)}


# one server per backend, each a minute or more on a 2-core CPU: CI runs xgrammar (the default);
# the others are slow (`pytest -m 'not gpu'` runs them)
@pytest.fixture(scope="module", params=[
    pytest.param(b, marks=[] if b == "xgrammar" else [pytest.mark.slow]) for b in sorted(BACKENDS)])
def srv(request):
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.plan.registry import get_registry
    from core.server.app import create_app

    name, package, jump = BACKENDS[request.param]
    pytest.importorskip(package)
    # auto picks xgrammar: name each backend, so that a missing one fails instead of another
    args = ServerArgs(api_key=KEY, max_total_tokens=4096, grammar_backend=name,
                      enable_jump_forward=jump)
    engine = Engine(server_args=args)
    assert engine.plan.grammar_backend == name
    try:
        with ServerThread(create_app(AsyncEngine(engine, "smollm2"), args)) as s:
            s.grammar, s.engine = name, engine
            s.caps = get_registry().get("grammar", name).caps
            yield s
    finally:
        engine.close()


def person(srv) -> dict:
    """A person's schema, its age range only where the backend enforces minimum / maximum."""
    age = {"type": "integer", **({} if set(AGE_RANGE) & srv.caps.schema_lacks else AGE_RANGE)}
    return {"type": "object", "required": ["name", "age"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 16}, "age": age}}


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_chat_json_schema_validates(srv):
    schema = person(srv)
    r = client(srv).chat.completions.create(
        model="smollm2", messages=ASK, temperature=0, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_completion_json_object_parses(srv):
    r = client(srv).completions.create(model="smollm2", prompt="A JSON object with a color:",
                                       temperature=0, max_tokens=48,
                                       extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_completion_regex_fullmatches(srv):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    r = client(srv).completions.create(model="smollm2", prompt="A ticket code:", temperature=0,
                                       max_tokens=16, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_chat_choice_with_n_gives_each_sequence_its_own_matcher(srv):
    choices = ["red", "green", "blue"]
    r = client(srv).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Pick a color."}], n=3,
        temperature=1.0, seed=7, max_tokens=8, extra_body={"guided_choice": choices})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.message.content in choices and c.finish_reason == "stop"


def test_streaming_with_a_schema(srv):
    schema = person(srv)
    stream = client(srv).chat.completions.create(
        model="smollm2", messages=ASK, temperature=0, max_tokens=64, stream=True,
        extra_body={"guided_json": schema})
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_jump_forward_computes_forced_tokens_in_extends(srv):
    """On the jump-forward server the schemas' forced keys and punctuation were appended and
    computed by extends (the engine's counters), and what it answers still validates."""
    if not srv.engine.args.enable_jump_forward:
        pytest.skip(f"jump-forward is off on the {srv.grammar} server")
    before = srv.engine.stats()
    schema = person(srv)
    r = client(srv).completions.create(model="smollm2", prompt="A person as JSON:",
                                       temperature=0, max_tokens=64,
                                       extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    after = srv.engine.stats()
    assert after["jumps"] > before["jumps"] and after["jump_tokens"] >= before["jump_tokens"] + 3


def test_generate_takes_sglang_sampling_params(srv):
    status, _, raw = http_request(srv.url, "POST", "/generate", {
        "text": "The answer is", "sampling_params": {"regex": "(yes|no)", "temperature": 0,
                                                     "max_new_tokens": 8}}, AUTH)
    assert status == 200, raw
    assert json.loads(raw)["text"] in ("yes", "no")


def _by_caps(srv, words):
    return words(srv) if callable(words) else words


@pytest.mark.parametrize("extra,param,words", [
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                     "maxLength": "x"}}}}}},
     "response_format.json_schema.schema",
     "invalid JSON schema"),
    ({"regex": "a(b"}, "regex", "invalid regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar",
     lambda s: "invalid EBNF grammar" if "ebnf" in s.caps.constraints else
     f"grammar backend {s.grammar} does not support ebnf constraints"),
    ({"json_schema": '{"type": "string", "contentEncoding": "base64"}'}, "json_schema",
     lambda s: f"uses contentEncoding, which grammar backend {s.grammar} cannot enforce"),
    ({"regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     "give one structured-output constraint"),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<g>"]}},
     "response_format", "every structure's begin must start with one of the triggers"),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}},
     "response_format", lambda s: "does not support structural_tag" if "structural_tag" not in
     s.caps.constraints else "__accepted__"),
], ids=["schema", "schema-value", "regex", "ebnf", "lacked-keyword", "two", "tag-trigger",
        "tag-unsupported"])
def test_invalid_constraints_are_400_naming_them(srv, extra, param, words):
    words = _by_caps(srv, words)
    if words == "__accepted__":
        pytest.skip(f"{srv.grammar} declares structural_tag: test_structural_tag covers it")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client(srv).chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                                stream=stream, extra_body=extra)
        assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


NEVER_FINISH = [
    ({"guided_grammar": "root ::= root"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "string", "pattern": "^[\\x01-\\x08]+$"}}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("extra,param", NEVER_FINISH, ids=["self-rule", "control-pattern"])
def test_a_constraint_that_can_never_finish_is_a_400_not_an_abort(srv, extra, param):
    """Issue 32: `root ::= root` and a JSON-schema pattern of control characters ended as a 200
    with finish_reason "abort" and no message. Now a backend that cannot satisfy them refuses
    them with a 400 naming the constraint (at compile: no first token; mid-answer: a dead end),
    streamed too; a backend that can (llguidance writes control characters as escapes) answers."""
    for stream in (False, True):
        try:
            r = client(srv).chat.completions.create(model="smollm2", messages=ASK, max_tokens=8,
                                                    temperature=0, stream=stream,
                                                    extra_body=extra)
            finishes = [c.choices[0].finish_reason for c in r] if stream else \
                [r.choices[0].finish_reason]
        except openai.APIError as e:  # a 400, or its error event once the stream began
            body = e.body if isinstance(e.body, dict) and "message" in e.body else \
                (e.body or {}).get("error", {})
            assert isinstance(e, openai.BadRequestError) or stream, e
            assert body.get("param") == param, body
            assert any(w in body.get("message", "") for w in (
                "can never be satisfied", "does not support", "cannot enforce")), body
            continue
        assert "abort" not in finishes and finishes[-1] in ("stop", "length"), finishes
        assert (srv.grammar, param) == ("llguidance", NEVER_FINISH[1][1]), \
            f"{srv.grammar} answered {finishes}"


def test_structural_tag_is_served(srv):
    """SGLang's / vLLM's response_format structural_tag reaches the grammar (xgrammar): the
    request is served, and any tagged part of the answer is JSON of its schema (what the
    grammar enforces after the trigger is tested token by token in tests/test_grammar.py)."""
    if "structural_tag" not in srv.caps.constraints:
        pytest.skip(f"{srv.grammar} does not declare structural_tag (a 400, tested above)")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "structural_tag", "triggers": ["<tool>"], "structures": [
        {"begin": "<tool>", "schema": schema, "end": "</tool>"}]}
    r = client(srv).completions.create(model="smollm2", prompt="Call the tool for Paris:",
                                       temperature=0, max_tokens=48,
                                       extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason in ("stop", "length")
    for m in re.finditer(r"<tool>(.*?)</tool>", r.choices[0].text, re.S):
        jsonschema.validate(json.loads(m.group(1)), schema)


def test_a_fake_engine_refuses_constraints_instead_of_ignoring_them():
    from core.server.app import create_app

    with ServerThread(create_app(FakeEngine(), ServerArgs(api_key=KEY))) as fake:
        for body in ({"regex": "a+"}, {"response_format": {"type": "json_object"}},
                     {"structured_outputs": {"choice": ["a", "b"]}}):
            status, _, raw = http_request(fake.url, "POST", "/v1/completions",
                                          {"prompt": "x", **body}, AUTH)
            err = json.loads(raw)["error"]
            assert status == 400 and "structured output is off" in err["message"], raw
        status, _, raw = http_request(fake.url, "POST", "/v1/completions", {
            "prompt": "x", "response_format": {"type": "text"}, "max_tokens": 2}, AUTH)
        assert status == 200, raw
