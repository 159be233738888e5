"""Tool calling without a model: the tool-call parsers on canned model outputs (hermes and llama3
case by case; what holds for every parser is the conformance suite, run over every registered
one by tests/test_tool_parser_conformance.py), the streamed deltas against the final message, the
request fields and the constraints of tool_choice required / named, the prompt for a template
that ignores tools (SmolLM2's), the resolver's choice, and `auto` end to end through the server
on the fake engine with the official `openai` client. The real model: tests/test_tools_server.py.
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from conformance.server_kit import FakeEngine, ServerThread
from core.contract.tools import (
    MAX_ARGUMENT_DEPTH,
    json_depth,
    make_tool_parser,
    template_reads_tools,
)
from core.plan.args import ServerArgs
from core.plan.plan import ResolveError
from core.plan.registry import get_registry
from core.server.errors import APIError
from core.server.tools import (
    CallArray,
    NamedCall,
    ServerTools,
    ToolRequest,
    ToolStream,
    final_message,
    parse_tools,
    tool_constraint,
)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TREQ = ToolRequest((WEATHER, TIME), "auto")
PARSERS = sorted(get_registry().kind("tool_parser"))


def parser(name: str):
    return make_tool_parser(get_registry(), name)


def streamed(p, treq: ToolRequest, text: str, step: int = 1) -> tuple[str, list[dict], list]:
    """Feed `text` in pieces of `step` characters: (content, calls joined from the deltas, the
    deltas)."""
    s = ToolStream(p, treq)
    deltas = []
    for i in range(step, len(text) + step, step):
        deltas += s.step(text[:i], False)
    deltas += s.step(text, True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                assert set(c) == {"index", "id", "type", "function"}, c
                assert c["id"].startswith("call_") and c["type"] == "function"
                assert c["function"]["arguments"] == ""
                calls.append({"id": c["id"], "name": c["function"]["name"], "arguments": ""})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return content, calls, deltas


def final(p, treq: ToolRequest, text: str) -> tuple[str | None, list[tuple[str, str]], str]:
    msg, finish = final_message(p, treq, text, "stop")
    return msg["content"], [(c["function"]["name"], c["function"]["arguments"])
                            for c in msg.get("tool_calls", ())], finish


def agree(p, treq: ToolRequest, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The final message, checked against the stream at several step sizes (same content,
    same calls, arguments joined from fragments equal to the final string)."""
    content, calls, finish = final(p, treq, text)
    assert finish == ("tool_calls" if calls else "stop")
    for step in (1, 3, 7):
        s_content, s_calls, _ = streamed(p, treq, text, step)
        assert s_content == (content or ""), (step, s_content, content)
        assert [(c["name"], c["arguments"]) for c in s_calls] == calls, step
    return content, calls


# -- every registered parser ---------------------------------------------------------------------

@pytest.mark.parametrize("name", PARSERS)
def test_parser_offers_tools_deterministically(name):
    p = parser(name)
    prompt = p.tools_prompt([WEATHER, TIME])
    assert prompt == p.tools_prompt([WEATHER, TIME])
    assert "result" in p.format_response("result", "get_time")
    if get_registry().get("tool_parser", name).caps.prompts:  # offered in system messages
        assert json.dumps(WEATHER) in prompt and json.dumps(TIME) in prompt


# -- hermes ---------------------------------------------------------------------------------------

H_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_text_then_call():
    assert agree(parser("hermes"), TREQ, "Let me check.\n" + H_CALL) == (
        "Let me check.", [("get_weather", '{"city": "Paris"}')])


def test_hermes_several_calls_and_text_between():
    text = (H_CALL + "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
            "\nDone.")
    assert agree(parser("hermes"), TREQ, text) == (
        "Done.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


# (text, whether the stream finds it out before a call header went out)
MALFORMED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": "city=Paris"}\n</tool_call>', True),
    ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', True),  # no name
    ('<tool_call>\n["get_weather"]\n</tool_call>', True),
    ('<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {}, "id": 3}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {}} trailing\n</tool_call>', False),
]


@pytest.mark.parametrize("bad,early", MALFORMED)
def test_hermes_malformed_call_stays_content(bad, early):
    p = parser("hermes")
    content, calls, finish = final(p, TREQ, "Sure. " + bad)
    assert (content, calls, finish) == ("Sure. " + bad, [], "stop")
    s_content, s_calls, _ = streamed(p, TREQ, "Sure. " + bad)
    assert s_content == content  # the markup is content, streamed or not
    if early:
        assert s_calls == []
    else:  # a header went out before the JSON broke: it cannot be taken back
        assert [c["name"] for c in s_calls] == ["get_weather"]


def test_hermes_call_without_closing_tag_at_the_end():
    text = 'I will call it.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    assert agree(parser("hermes"), TREQ, text) == ("I will call it.", [("get_time", "{}")])


def test_hermes_unfinished_call_at_the_end_is_content():
    text = 'Hm <tool_call>\n{"name": "get_time", "argu'
    assert final(parser("hermes"), TREQ, text) == (text, [], "stop")


def test_hermes_function_not_offered_stays_content():
    text = 'x <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert agree(parser("hermes"), TREQ, text) == (text, [])


def test_hermes_streaming_holds_back_a_marker_split_across_tokens():
    p = parser("hermes")
    s = ToolStream(p, TREQ)
    assert s.step("Hello <tool_c", False) == [{"content": "Hello"}]
    assert s.step("Hello <tool_cat", False) == [{"content": " <tool_cat"}]  # no marker after all
    s = ToolStream(p, TREQ)
    out = s.step("Hello <tool_call>\n{\"name\": \"get_", False)
    assert out == [{"content": "Hello"}]  # the name is not read yet: no header, no markup
    assert s.step("Hello <tool_call>\n{\"name\": \"get_time\", \"arguments\": ", False) == []
    out = s.step("Hello <tool_call>\n{\"name\": \"get_time\", \"arguments\": {", False)
    assert out[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert out[1]["tool_calls"][0]["function"] == {"arguments": "{"}


def test_no_parallel_tool_calls_keeps_the_first():
    text = H_CALL + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    one = ToolRequest((WEATHER, TIME), "auto", parallel=False)
    assert agree(parser("hermes"), one, text) == (None, [("get_weather", '{"city": "Paris"}')])


# -- llama3 ---------------------------------------------------------------------------------------

L_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("text,want", [
    (L_CALL, (None, [("get_weather", '{"city": "Paris"}')])),
    ("  " + L_CALL + "\n", (None, [("get_weather", '{"city": "Paris"}')])),
    ("Let me see.<|python_tag|>" + L_CALL, ("Let me see.", [("get_weather",
                                                              '{"city": "Paris"}')])),
    (L_CALL + '; {"name": "get_time", "parameters": {}}',
     (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ('{"name": "get_time", "arguments": {}}', (None, [("get_time", "{}")])),
])
def test_llama3_calls(text, want):
    assert agree(parser("llama3"), TREQ, text) == want


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # a JSON answer is no call
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # unclosed
    L_CALL + " and then some text",
    L_CALL + '; {"name": "get_time", "parameters": [1]}',  # the second is malformed
    "The call would be " + L_CALL,  # a call after text, without the tag
    '{"name": "delete_everything", "parameters": {}}',  # not offered
])
def test_llama3_anything_else_is_content(text):
    content, calls, finish = final(parser("llama3"), TREQ, text)
    assert (content, calls, finish) == (text, [], "stop")


def test_llama3_reads_bare_calls_first_and_writes_the_tag():
    p = parser("llama3")
    # the tag's text inside an argument string is no tag: the answer is a bare call
    text = '{"name": "get_weather", "parameters": {"city": "<|python_tag|>"}}'
    assert agree(p, TREQ, text) == (None, [("get_weather", '{"city": "<|python_tag|>"}')])
    # a JSON answer that is no call, then the tag and a call
    assert agree(p, TREQ, '{"a": 1}<|python_tag|>' + L_CALL) == (
        '{"a": 1}', [("get_weather", '{"city": "Paris"}')])
    # format_calls writes the tag, so calls after content (a replayed turn) read back
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert p.format_calls(calls) == "<|python_tag|>" + L_CALL
    assert agree(p, TREQ, "Checking.\n" + p.format_calls(calls)) == (
        "Checking.", [("get_weather", '{"city": "Paris"}')])
    assert p.parse("  \n", False) == [""]  # leading spaces may come before a call
    assert p.parse("  \n", True) == ["  \n"]


def test_hermes_closing_tag_inside_an_argument_string():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> x"}}\n'
            '</tool_call>')
    assert agree(parser("hermes"), TREQ, text) == (
        None, [("get_weather", '{"city": "</tool_call> x"}')])


def test_llama3_streaming_holds_a_json_answer_until_known():
    p = parser("llama3")
    s = ToolStream(p, TREQ)
    assert s.step('{"answ', False) == []
    assert s.step('{"answer": 4', False) == []
    assert s.step('{"answer": 42}', True) == [{"content": '{"answer": 42}'}]


# -- nesting (issue 32: RecursionError on arguments ~1,200 deep) -----------------------------------

def _nested_object(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def _call_text(name: str, args: str) -> str:
    """A call to get_weather with these arguments (JSON text) in parser `name`'s format."""
    if name == "gpt-oss":  # harmony: the body is the arguments object
        return ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                f"<|constrain|>json<|message|>{args}<|call|>")
    key = "arguments" if name == "hermes" else "parameters"
    body = '{"name": "get_weather", "' + key + '": ' + args + "}"
    return f"<tool_call>\n{body}\n</tool_call>" if name == "hermes" else body


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH + 1, 1200, 100_000])
def test_arguments_nested_past_the_limit_stay_content_and_never_raise(name, depth):
    """A call whose arguments nest deeper than MAX_ARGUMENT_DEPTH is not well formed: its text
    is the content, verbatim, one-shot and streamed (hermes and llama3 raised RecursionError
    from json.loads at ~1,000 levels)."""
    p = parser(name)
    text = _call_text(name, _nested_object(depth))
    assert p.parse(text, True) and "".join(p.parse(text, True)) == text
    p.parse(text[:len(text) // 3], False)  # (a call may still be open there)
    for at in (len(text) - 1, len(text)):  # past the limit: known to be text
        assert all(isinstance(x, str) for x in p.parse(text[:at], False))
    assert final(p, TREQ, text) == (text.strip(), [], "stop")


@pytest.mark.parametrize("name", PARSERS)
def test_arguments_nested_to_the_limit_are_a_call(name):
    p = parser(name)
    args = _nested_object(MAX_ARGUMENT_DEPTH)
    text = _call_text(name, args)
    assert final(p, TREQ, text) == (None, [("get_weather", args)], "tool_calls")


def test_json_depth_counts_brackets_outside_strings_without_recursing():
    assert json_depth('{"a": [1, {"b": "[[[{{{"}], "c": []}') == 3
    assert json_depth("42") == 0 and json_depth('"[["') == 0
    assert json_depth("[" * 200_000 + "]" * 200_000) == 200_000


def test_replayed_call_arguments_nested_past_the_limit_are_a_400():
    """An assistant message's tool_calls arguments are read with json.loads: nested past the
    limit they are a 400 naming the field (they raised RecursionError, a 500)."""
    from core.server.tools import message_fields

    deep = "[" * 100_000 + "]" * 100_000
    for args in (deep, '{"x": ' + _nested_object(MAX_ARGUMENT_DEPTH) + "}"):
        m = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": args}}]}
        with pytest.raises(APIError) as e:
            message_fields(m, "messages[1]", "assistant")
        assert e.value.status == 400
        assert e.value.param == "messages[1].tool_calls[0].function.arguments", e.value.param
        assert str(MAX_ARGUMENT_DEPTH) in e.value.message
    ok = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": _nested_object(MAX_ARGUMENT_DEPTH)}}]}
    message_fields(ok, "messages[1]", "assistant")


# -- constrained answers (required / named) -------------------------------------------------------

def test_named_and_required_answers_are_read_directly():
    named = ToolRequest((WEATHER, TIME), "named", "get_weather")
    assert agree(NamedCall("get_weather"), named, '{"city": "Oslo"}') == (
        None, [("get_weather", '{"city": "Oslo"}')])
    req = ToolRequest((WEATHER, TIME), "required")
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", ' \
           '"parameters": {"city": "Oslo"}}]'
    assert agree(CallArray("parameters"), req, text) == (
        None, [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')])


def test_constraint_schemas_accept_exactly_calls():
    named = tool_constraint(ToolRequest((WEATHER, TIME), "named", "get_weather"), "arguments")
    assert named["source"] == "tools[0].function.parameters"
    assert json.loads(named["value"]) == WEATHER["function"]["parameters"]
    req = tool_constraint(ToolRequest((WEATHER, TIME), "required"), "arguments")
    schema = json.loads(req["value"])
    jsonschema.validate([{"name": "get_time", "arguments": {}},
                         {"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],  # city is required
                [{"name": "nope", "arguments": {}}], [{"name": "get_time"}],
                [{"name": "get_time", "arguments": {"x": 1}}]):  # no parameters: none
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(tool_constraint(ToolRequest((WEATHER, TIME), "required", parallel=False),
                                     "arguments")["value"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, one)
    assert tool_constraint(ToolRequest((WEATHER,), "auto"), "arguments") is None


# two tools that each define a DataType of their own (SGLang's
# test_conflicting_defs_required_tool_choice), one recursive through "#", one with definitions
SET_DATA = {"type": "function", "function": {"name": "set_data", "parameters": {
    "type": "object", "required": ["value"], "additionalProperties": False,
    "properties": {"value": {"$ref": "#/$defs/DataType"}},
    "$defs": {"DataType": {"type": "string", "enum": ["alpha", "beta"]}}}}}
SET_COUNT = {"type": "function", "function": {"name": "set_count", "parameters": {
    "type": "object", "required": ["value"], "additionalProperties": False,
    "properties": {"value": {"$ref": "#/$defs/DataType"}},
    "$defs": {"DataType": {"type": "integer"}}}}}
TREE = {"type": "function", "function": {"name": "make_tree", "parameters": {
    "type": "object", "required": ["label"], "additionalProperties": False,
    "properties": {"label": {"$ref": "#/definitions/Label"},
                   "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
                   "enum": {"const": {"$ref": "#/not/a/reference"}}},
    "definitions": {"Label": {"type": "string", "maxLength": 8}}}}}


def test_required_keeps_each_tools_own_definitions():
    req = tool_constraint(ToolRequest((SET_DATA, SET_COUNT, TREE, TIME), "required"), "a")
    schema = json.loads(req["value"])
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "set_data", "a": {"value": "alpha"}},
                         {"name": "set_count", "a": {"value": 3}},
                         {"name": "make_tree", "a": {"label": "x", "kids": [
                             {"label": "y", "kids": [{"label": "z"}]}]}},
                         {"name": "make_tree", "a": {"label": "x",
                                                     "enum": {"$ref": "#/not/a/reference"}}},
                         {"name": "get_time", "a": {}}], schema)
    for bad in ({"name": "set_data", "a": {"value": 3}},  # set_count's DataType, not its own
                {"name": "set_count", "a": {"value": "alpha"}},
                {"name": "make_tree", "a": {"label": "x", "kids": [{"label": 1}]}},
                {"name": "make_tree", "a": {"label": "much too long"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    # the tools given are untouched; a tool without references stays inline
    assert SET_DATA["function"]["parameters"]["properties"]["value"] == {
        "$ref": "#/$defs/DataType"}
    assert set(schema["$defs"]) == {"set_data", "set_count", "make_tree"}
    plain = json.loads(tool_constraint(ToolRequest((WEATHER, TIME), "required"), "a")["value"])
    assert "$defs" not in plain


@pytest.mark.parametrize("backend,package,cls", [
    ("xgrammar", "xgrammar", "XGrammarBackend"), ("llguidance", "llguidance", "LLGuidanceBackend"),
    ("outlines", "outlines_core", "OutlinesBackend")])
def test_required_with_definitions_compiles(backend, package, cls):
    """Each grammar backend takes the required schema of tools with their own $defs (xgrammar
    refused it: "Cannot find field '$defs' in #/$defs/DataType")."""
    import importlib

    from core.contract.grammar import Constraint

    pytest.importorskip(package)
    backend_cls = getattr(importlib.import_module(f"plugins.grammar.{backend}.backend"), cls)
    c = tool_constraint(ToolRequest((SET_DATA, SET_COUNT), "required"), "arguments")
    backend_cls(tokenizer=None, vocab_size=0, stop_token_ids=[]).validate(
        Constraint(c["kind"], c["value"], c["source"]))


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "color": 1}}]},
     "tools[0].function.color"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [TIME, WEATHER, TIME]}, "tools[2].function.name"),
    ({"tools": [TIME], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "name": "get_time"}},
     "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tools": [TIME], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict"),
])
def test_malformed_tool_fields_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_fields_that_ask_for_nothing():
    for body in ({}, {"tools": []}, {"tools": None, "tool_choice": "none"},
                 {"tool_choice": "auto", "parallel_tool_calls": False}):
        assert parse_tools(body) is None
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    assert parse_tools({"tools": [strict], "tool_choice": "required"}).choice == "required"
    assert parse_tools({"tools": [TIME]}).choice == "auto"


# -- the prompt ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from core.plan.default_model import default_model_path
    from core.tokenizer import Tokenizer

    path = default_model_path()
    return Tokenizer.from_path(os.path.dirname(path), gguf_file=os.path.basename(path))


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1",
     "name": "get_weather"},
    {"role": "tool", "content": '{"rain": false}', "tool_call_id": "call_1"},
]


def test_smollm2_template_ignores_tools_so_they_go_in_a_system_message(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert not template_reads_tools(tok.chat_template)
    ask = [{"role": "user", "content": "hi"}]
    # the template itself drops them: this is what the server must not rely on
    assert tok.apply_chat_template(ask, tools=[WEATHER]) == tok.apply_chat_template(ask)
    st = ServerTools("hermes", tok.chat_template)
    treq = ToolRequest((WEATHER, TIME), "auto")
    msgs, tools = st.render(CONVERSATION, treq)
    assert tools is None
    text = tok.apply_chat_template(msgs)
    hermes = parser("hermes")
    assert text.startswith("<|im_start|>system\n" + hermes.tools_prompt([WEATHER, TIME]))
    assert "<|im_start|>assistant\n" + hermes.format_calls(
        [{"name": "get_weather", "arguments": {"city": "Paris"}}]) + "<|im_end|>" in text
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
            "<tool_response>\n{\"rain\": false}\n</tool_response><|im_end|>") in text
    assert st.render(CONVERSATION, treq) == (msgs, None)  # deterministic
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    msgs, _ = st.render(with_system, treq)
    assert msgs[0] == {"role": "system", "content": "Be brief.\n\n" + hermes.tools_prompt(
        [WEATHER, TIME])} and len(msgs) == 2


def test_a_template_that_reads_tools_gets_them(smollm2_tokenizer):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.arguments | tojson }}>"
                "{% endfor %}\n{% endfor %}")
    assert template_reads_tools(template)
    st = ServerTools("hermes", template)
    msgs, tools = st.render(CONVERSATION, ToolRequest((WEATHER,), "auto"))
    assert msgs is CONVERSATION and tools == [WEATHER]
    tok = smollm2_tokenizer
    from core.tokenizer import Tokenizer

    text = Tokenizer(tok.hf, chat_template=template).apply_chat_template(
        msgs, add_generation_prompt=False, tools=tools)
    assert text.startswith("[get_weather]user:Weather in Paris?assistant:<{\"city\": "
                           "\"Paris\"}>tool:")


# -- the resolver's choice ------------------------------------------------------------------------

QWEN_LIKE = ("{% if tools %}<tools>{{ tools | tojson }}</tools> reply with <tool_call>"
             "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
LLAMA31_LIKE = ('{% if tools %}{"name": function name, "parameters": dictionary of argument '
                'name and its value}{% endif %}{{ "<|python_tag|>" }}')


@pytest.fixture(scope="module")
def plan():
    from core.engine.worker import make_plan

    args, plan, spec, registry = make_plan(ServerArgs())
    return plan


def _choose(plan, template, flag="auto"):
    from core.plan.resolver import resolve_tool_parser

    return resolve_tool_parser(plan, template, ServerArgs(tool_call_parser=flag),
                               get_registry())


def test_auto_picks_by_the_templates_markup(plan, smollm2_tokenizer):
    got = _choose(plan, smollm2_tokenizer.chat_template)
    assert got.tool_call_parser == "hermes"
    assert any("no registered parser's tool markup" in n for n in got.notes)
    assert any("never reads `tools`" in n for n in got.notes)
    assert _choose(plan, QWEN_LIKE).tool_call_parser == "hermes"
    llama = _choose(plan, LLAMA31_LIKE)
    assert llama.tool_call_parser == "llama3"
    rows = {c.name: c for c in llama.candidates if c.slot == "tool_call_parser"}
    assert rows["llama3"].chosen and not rows["hermes"].fits
    assert "holds none of its markers (<tool_call>)" in rows["hermes"].reasons[0]
    from core.plan.resolver import explain

    assert "tool-call parser   llama3" in explain(llama)


def test_named_aliases_and_none(plan):
    assert _choose(plan, QWEN_LIKE, "qwen25").tool_call_parser == "hermes"
    got = _choose(plan, QWEN_LIKE, "llama3_json")
    assert got.tool_call_parser == "llama3"
    assert any("shows none of its markers" in n for n in got.notes)
    off = _choose(plan, QWEN_LIKE, "none")
    assert off.tool_call_parser is None and any("auto tool calls off" in n for n in off.notes)
    with pytest.raises(ResolveError) as e:
        _choose(plan, QWEN_LIKE, "mistral")
    assert "hermes (also qwen, qwen25, qwen3)" in str(e.value)


def test_a_named_parser_missing_its_package_fails_at_resolve_time(plan):
    from core.contract.capabilities import ToolParserCaps
    from core.contract.hookspecs import hookimpl
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve_tool_parser

    class Needy:
        @hookimpl
        def core_register_tool_parsers(self, register):
            register("needy", ToolParserCaps(markers=("<needy>",),
                                             requires=("no_such_package_xyz",)), object)

    reg = build_registry(extra=[("needy", Needy())])
    with pytest.raises(ResolveError, match="package no_such_package_xyz is not installed"):
        resolve_tool_parser(plan, "<needy>", ServerArgs(tool_call_parser="needy"), reg)
    # auto: the template holds only needy's markup, which nothing installed can read
    got = resolve_tool_parser(plan, "<needy>", ServerArgs(), reg)
    row = next(c for c in got.candidates if c.name == "needy")
    assert not row.fits and "package no_such_package_xyz is not installed" in row.reasons
    assert got.tool_call_parser is None
    assert any(n.startswith("auto tool calls off: no tool-call parser fits") for n in got.notes)


def test_unknown_parser_fails_before_the_engine_starts():
    from core.engine.worker import make_plan

    with pytest.raises(ResolveError, match="unknown tool-call parser 'nope'"):
        make_plan(ServerArgs(tool_call_parser="nope"))


# -- auto end to end on the fake engine ----------------------------------------------------------

KEY = "sk-tools"
REPLY = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}\n</tool_call>END')


@pytest.fixture(scope="module")
def fake():
    from core.server.app import create_app

    engine = FakeEngine(context_length=4096, reply=REPLY, tool_call_parser="hermes")
    with ServerThread(create_app(engine, ServerArgs(api_key=KEY))) as s:
        yield s


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_auto_through_the_server(fake):
    r = _client(fake).chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER],
                                              max_tokens=400, stop=["END"])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the tools reached the prompt as hermes' system message (the fake template ignores them)
    from core.server.state import STATE

    sent = fake.call(lambda: fake.app[STATE].engine.submitted[-1].input_ids)
    prompt = bytes(i - 3 for i in sent).decode()
    assert prompt.startswith("<system># Tools") and json.dumps(WEATHER) in prompt


def test_auto_streamed_through_the_server(fake):
    stream = _client(fake).chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER], max_tokens=400, stop=["END"],
        stream=True)
    content, args, heads, reasons = "", "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0
                if tc.id:
                    heads.append((tc.id, tc.type, tc.function.name, tc.function.arguments))
                else:
                    args += tc.function.arguments
            reasons.append(c.finish_reason)
    assert content == "Checking." and "<tool_call>" not in content
    assert len(heads) == 1 and heads[0][1:] == ("function", "get_weather", "")
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_auto_streamed_token_ids_are_all_sent(fake):
    """return_token_ids on a streamed chat read for tool calls: every token's id comes in some
    chunk's token_ids, those of text held back (the call's markup) too."""
    stream = _client(fake).chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER], max_tokens=400, stop=["END"],
        stream=True, extra_body={"return_token_ids": True})
    ids = [t for chunk in stream for c in chunk.choices
           for t in (c.model_extra.get("token_ids") or ())]
    r = _client(fake).chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER], max_tokens=400, stop=["END"],
        extra_body={"return_token_ids": True})
    assert ids == r.choices[0].model_extra["token_ids"]
    assert bytes(t - 3 for t in ids).decode().startswith(REPLY[:-3])


def test_none_parses_nothing(fake):
    r = _client(fake).chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER],
                                              tool_choice="none", max_tokens=400, stop=["END"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert c.message.content == REPLY[:-3]


def test_auto_without_a_parser_is_refused():
    from core.server.app import create_app

    with ServerThread(create_app(FakeEngine(context_length=4096), ServerArgs(api_key=KEY))) \
            as srv:
        replayed = [{"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "21C", "tool_call_id": "call_1"}]
        for extra, param in (({"tools": [WEATHER]}, "tools"),
                             ({"messages": ASK + replayed}, "messages")):
            with pytest.raises(openai.BadRequestError) as e:
                _client(srv).chat.completions.create(
                    model="fake-model", max_tokens=4, **{"messages": ASK, **extra})
            assert e.value.body["param"] == param and e.value.body["code"] == "unsupported"
