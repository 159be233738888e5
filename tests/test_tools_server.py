"""Tool calling through the real server on SmolLM2 (xgrammar), with the official `openai`
client: tool_choice required and named give calls whose arguments parse and follow the tool's
schema, streamed too (the fragments join to the non-streamed string); a conversation with tool
calls and tool results goes back in; malformed tool fields are 400s naming them. One server for
the module. The parsers on canned outputs: tests/test_tools.py."""

from __future__ import annotations

import json

import openai
import pytest

from core.plan.args import ServerArgs

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                   "properties": {"zone": {"type": "string", "maxLength": 12}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def srv():
    from conformance.server_kit import ServerThread
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    args = ServerArgs(api_key=KEY, max_total_tokens=4096)
    engine = Engine(server_args=args)
    try:
        adapter = AsyncEngine(engine, "smollm2")
        assert adapter.plan.tool_call_parser == "hermes"  # no tool markup in SmolLM2's template
        with ServerThread(create_app(adapter, args)) as s:
            yield s
    finally:
        engine.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _check(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(stream) -> tuple[str, list[dict], list]:
    content, calls, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.index == len(calls):  # the first delta of a call
                    assert tc.id.startswith("call_") and tc.type == "function"
                    assert tc.function.name and tc.function.arguments == ""
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
            reasons.append(c.finish_reason)
    return content, calls, reasons


def test_plan_shows_the_parser(srv):
    from conformance.server_kit import http_request

    status, _, raw = http_request(srv.url, "GET", "/get_server_info", None,
                                  {"Authorization": f"Bearer {KEY}"})
    plan = json.loads(raw)["plan"]
    assert status == 200 and plan["tool_call_parser"] == "hermes"
    assert any(c["slot"] == "tool_call_parser" and c["chosen"] for c in plan["candidates"])


def test_named_function(srv):
    r = client(srv).chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                            tool_choice=NAMED, temperature=0, max_tokens=48)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _check(call.function.name, call.function.arguments)
    s_content, s_calls, reasons = _streamed(client(srv).chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
        max_tokens=48, stream=True))
    assert s_content == "" and reasons[-1] == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in s_calls] == [
        ("get_weather", call.function.arguments)]


@pytest.mark.slow  # ~40 s on a loaded 2-core CPU; CI keeps required without parallel calls
def test_required(srv):
    r = client(srv).chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=96)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        _check(call.function.name, call.function.arguments)
    assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)
    s_content, s_calls, reasons = _streamed(client(srv).chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=96, stream=True))
    assert s_content == "" and reasons[-1] == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in s_calls] == [
        (call.function.name, call.function.arguments) for call in c.message.tool_calls]


def test_required_without_parallel_calls_gives_one(srv):
    r = client(srv).chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=3, n=2, max_tokens=96)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _check(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)


def test_required_with_tools_that_define_the_same_name(srv):
    """Two tools each with their own $defs DataType (SGLang's
    test_conflicting_defs_required_tool_choice): a 400 "Cannot find field '$defs'" before;
    now each call's arguments follow its own tool's DataType."""
    def tool(name: str, data_type: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": ["value"], "additionalProperties": False,
            "properties": {"value": {"$ref": "#/$defs/DataType"}},
            "$defs": {"DataType": data_type}}}}

    tools = [tool("set_color", {"enum": ["red", "green"]}),
             tool("set_size", {"enum": ["small", "large"]})]
    r = client(srv).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Make it red."}], tools=tools,
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    params = next(t["function"]["parameters"] for t in tools
                  if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), params)


@pytest.mark.slow  # ~30 s on a loaded 2-core CPU (three generations)
def test_round_trip_with_tool_results(srv):
    c = client(srv)
    first = c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                      tool_choice=NAMED, temperature=0, max_tokens=48)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    # the SDK's reply object goes back as it is, then the tool's answer
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = c.chat.completions.create(model="smollm2", messages=history, tools=TOOLS,
                                  temperature=0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # with the nulls the SDK writes for the fields a reply leaves empty (content, refusal...)
    nulls = c.chat.completions.create(model="smollm2", messages=[
        *ASK, msg.model_dump(), history[-1]], tools=TOOLS, temperature=0, max_tokens=16)
    assert nulls.usage.prompt_tokens == r.usage.prompt_tokens
    bigger = [*history[:-1], {**history[-1], "content": '{"temperature": 21} ' * 20}]
    r2 = c.chat.completions.create(model="smollm2", messages=bigger, tools=TOOLS,
                                   temperature=0, max_tokens=1)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the tool result reached the prompt
    plain = c.chat.completions.create(model="smollm2", messages=ASK, temperature=0,
                                      max_tokens=1)
    with_tools = c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=1)
    # none: no call parsed, but the tools are still offered (vLLM's default)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_auto_answers_with_text_or_valid_calls(srv):
    r = client(srv).chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                            temperature=0, max_tokens=64)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert isinstance(c.message.content, str)


_FN = {"type": "function", "function": {"name": "f"}}
BAD = [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [_FN, _FN]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get_time",
                                                     "arguments": "zone=UTC"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
     "messages[0].tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_malformed_tool_requests_are_400_naming_the_field(srv, extra, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client(srv).chat.completions.create(
                model="smollm2", max_tokens=4, stream=stream,
                **{"messages": ASK, **{k: v for k, v in extra.items() if k == "messages"}},
                extra_body={k: v for k, v in extra.items() if k != "messages"})
        assert e.value.body["param"] == param, e.value.body
