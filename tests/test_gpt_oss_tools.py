"""The `gpt-oss` tool-call parser (plugins/tool_parsers/gpt_oss.py) on harmony as gpt-oss writes
it and as its chat template replays it, its agreement with the `gpt-oss` reasoning parser on
the channels (analysis: reasoning, final: content, commentary to=functions.NAME: a call),
whole and streamed through the server's two readers, the special tokens kept for it, the
resolver's choice from gpt-oss's template, and both parsers through the server on the fake
engine with the `openai` client. What holds for every parser: the conformance suite
(tests/test_tool_parser_conformance.py runs it over this one too)."""

from __future__ import annotations

import json

import openai
import pytest

from conformance.server_kit import FakeEngine, ServerThread
from conformance.tool_parser_suite import check_prompt
from core.contract.tools import ToolCall, make_tool_parser
from core.plan.args import ServerArgs
from core.plan.registry import get_registry
from core.server.reasoning import ChoiceReasoning
from core.server.tools import ServerTools, ToolRequest, ToolStream, final_message

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
LOOKUP = {"type": "function", "function": {"name": "memory.read"}}
TREQ = ToolRequest((WEATHER, LOOKUP), "auto")

ANALYSIS = "<|channel|>analysis<|message|>Need the weather in Paris.<|end|>"
# as gpt-oss writes a call (channel first, then the recipient; <|call|> is a stop token, so
# the text may end right after the arguments)
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
# as its chat template replays one (recipient first, a bare content type)
REPLAYED = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


def parser():
    return make_tool_parser(get_registry(), "gpt-oss")


def calls_of(pieces) -> list[tuple[str, dict]]:
    return [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]


def content_of(pieces) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


@pytest.mark.parametrize("text", [
    CALL,
    REPLAYED,
    CALL.removeprefix("<|start|>assistant"),  # right after the generation prompt
    CALL.removesuffix("<|call|>"),  # the stop token left out of the text
    CALL.replace(" <|constrain|>json", "<|constrain|>json"),
    CALL.replace(" <|constrain|>json", ""),
    CALL.replace("<|call|>", "<|end|>"),  # as one template variant replays it
])
def test_calls_in_each_harmony_spelling(text):
    pieces = parser().parse(text, True)
    assert calls_of(pieces) == [("get_weather", {"city": "Paris"})]
    assert content_of(pieces) == ""
    (call,) = [p for p in pieces if isinstance(p, ToolCall)]
    assert call.arguments == '{"city": "Paris"}' and call.raw in text and call.complete


def test_dotted_names_and_several_calls():
    p = parser()
    text = (CALL + '<|start|>assistant<|channel|>commentary to=functions.memory.read '
            '<|constrain|>json<|message|>{"key": "a"}<|call|>')
    assert calls_of(p.parse(text, True)) == [("get_weather", {"city": "Paris"}),
                                             ("memory.read", {"key": "a"})]
    assert calls_of(p.parse(p.format_calls([{"name": "memory.read", "arguments": {}}]),
                            True)) == [("memory.read", {})]


@pytest.mark.parametrize("text", [
    "<|start|>assistant<|channel|>analysis to=functions.get_weather<|message|>{}<|call|>",
    "<|start|>assistant<|channel|>commentary to=browser.search<|message|>{\"q\": 1}<|call|>",
    "<|channel|>commentary to=python<|message|>print(1)<|call|>",
    "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>",  # a preamble
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{}<|end|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>\"x\"<|call|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{\"a\": 1",
    ANALYSIS + FINAL,
])
def test_everything_else_is_content_verbatim(text):
    """Only commentary messages to functions.NAME with an object body are calls: analysis
    (reasoning, even addressed), the built-in tools, preambles, tool results, malformed or
    cut-off calls and final answers stay text as written."""
    pieces = parser().parse(text, True)
    assert calls_of(pieces) == [] and content_of(pieces) == text


def test_around_a_call_the_text_stays_verbatim():
    pieces = parser().parse(ANALYSIS + CALL, True)
    assert content_of(pieces) == ANALYSIS
    assert calls_of(pieces) == [("get_weather", {"city": "Paris"})]


def test_streaming_holds_a_header_until_it_is_known():
    p = parser()
    text = ANALYSIS + CALL.removesuffix("<|call|>")
    seen_content, named_at = [], None
    for i in range(1, len(text) + 1):
        pieces = p.parse(text[:i], False)
        seen_content.append(content_of(pieces))
        call = next((x for x in pieces if isinstance(x, ToolCall)), None)
        if named_at is None and call is not None and call.name is not None:
            named_at = i
    # content never shows the call's header; it is the analysis message, verbatim, and grows
    assert all(ANALYSIS.startswith(c) for c in seen_content)
    assert seen_content[-1] == ANALYSIS
    assert text[:named_at].endswith("<|message|>")  # the name is read with the whole header


def test_tools_prompt_and_responses():
    p = parser()
    check_prompt(p)  # the suite's checks (the caps do not declare prompts: not run there)
    prompt = p.tools_prompt([WEATHER, LOOKUP])
    assert "namespace functions {" in prompt and "type get_weather = (_: {" in prompt
    assert 'unit?: "celsius" | "fahrenheit",' in prompt and "city: string," in prompt
    assert p.format_response('{"temp": 21}', "get_weather") == (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
        '{"temp": 21}<|end|>')


# -- with the reasoning parser: the channels agree ------------------------------------------------

TRANSCRIPTS = [
    # (output after `<|start|>assistant`, reasoning, content, calls)
    (ANALYSIS + CALL.removesuffix("<|call|>"), "Need the weather in Paris.", None,
     [("get_weather", {"city": "Paris"})]),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Hi! 👋", "Need the weather in "
     "Paris.", "Hi! 👋", []),
    ("<|channel|>commentary to=functions.memory.read <|constrain|>json<|message|>{}",
     None, None, [("memory.read", {})]),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
     "Need the weather in Paris.",
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>",
     [("get_weather", {"city": "Paris"})]),
]


def _both_whole(text: str):
    split = ChoiceReasoning(make_reasoning(), False)
    reasoning, content = split.split(text)
    msg, finish = final_message(parser(), TREQ, content, "stop")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg.get("tool_calls", ())]
    return reasoning, msg["content"], calls, finish


def _both_streamed(text: str, step: int):
    """As core.server.generation streams a chat choice: the reasoning split first, the calls
    read from the content so far."""
    split = ChoiceReasoning(make_reasoning(), False)
    stream = ToolStream(parser(), TREQ)
    reasoning, content, calls = "", "", []
    for i in range(0, len(text), step):
        last = i + step >= len(text)
        delta = split.feed(text[i:i + step], last)
        reasoning += delta.get("reasoning_content", "")
        for d in stream.step(split.content, last):
            content += d.get("content", "")
            for c in d.get("tool_calls", ()):
                if c["index"] == len(calls):
                    calls.append([c["function"]["name"], ""])
                else:
                    calls[c["index"]][1] += c["function"]["arguments"]
    return reasoning or None, content or None, [(n, json.loads(a)) for n, a in calls]


def make_reasoning():
    return get_registry().get("reasoning_parser", "gpt-oss").load()()


@pytest.mark.parametrize("text,reasoning,content,calls", TRANSCRIPTS)
def test_reasoning_then_calls_whole_and_streamed(text, reasoning, content, calls):
    got = _both_whole(text)
    assert got == (reasoning, content, calls, "tool_calls" if calls else "stop")
    for step in (1, 2, 5, 11):
        assert _both_streamed(text, step) == (reasoning, content, calls), step


# -- the server ---------------------------------------------------------------------------------

def _request(**fields):
    from core.server.protocol import parse_chat

    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, 300, 4096)


def test_special_tokens_are_kept_for_its_calls():
    from core.server.errors import APIError

    specials = ("<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>")
    st = ServerTools("gpt-oss", "{{ tools }}", special_tokens=specials)
    req = _request(tools=[WEATHER])
    st.prepare(req)
    assert req.sampling["skip_special_tokens"] is False
    with pytest.raises(APIError) as e:
        st.prepare(_request(tools=[WEATHER], skip_special_tokens=True))
    assert e.value.status == 400 and e.value.param == "skip_special_tokens"
    none = _request(tools=[WEATHER], tool_choice="none", skip_special_tokens=True)
    st.prepare(none)  # nothing is parsed: the client's choice stands
    assert none.sampling["skip_special_tokens"] is True
    plain = _request()
    st.prepare(plain)  # no tools: nothing to read
    assert "skip_special_tokens" not in plain.sampling
    # hermes reads no special tokens; a tokenizer without harmony's has none to keep
    for other in (ServerTools("hermes", "{{ tools }}", special_tokens=specials),
                  ServerTools("gpt-oss", "{{ tools }}", special_tokens=("<|eos|>",))):
        req = _request(tools=[WEATHER])
        other.prepare(req)
        assert "skip_special_tokens" not in req.sampling


GPT_OSS_LIKE = (  # the part of gpt-oss's chat template that replays a tool call
    '{%- for m in messages %}{%- if m.tool_calls %}{{- "<|start|>assistant to=" }}'
    '{{- "functions." + m.tool_calls[0].function.name + "<|channel|>commentary " }}'
    '{{- "json<|message|>" }}{{- m.tool_calls[0].function.arguments|tojson }}'
    '{{- "<|call|>" }}{%- endif %}{%- endfor %}{{ tools }}<|start|>assistant')


def test_auto_picks_it_from_gpt_oss_template():
    from core.engine.worker import make_plan
    from core.plan.resolver import resolve_tool_parser

    _, plan, _, _ = make_plan(ServerArgs())
    got = resolve_tool_parser(plan, GPT_OSS_LIKE, ServerArgs(tool_call_parser="auto"),
                              get_registry())
    assert got.tool_call_parser == "gpt-oss"
    for alias in ("openai", "harmony"):
        assert resolve_tool_parser(plan, GPT_OSS_LIKE, ServerArgs(tool_call_parser=alias),
                                   get_registry()).tool_call_parser == "gpt-oss"


REPLY = ANALYSIS + CALL.removesuffix("<|call|>") + "END"


@pytest.fixture(scope="module")
def harmony_server():
    from core.server.app import create_app

    engine = FakeEngine(context_length=4096, reply=REPLY, reasoning_parser="gpt-oss",
                        tool_call_parser="gpt-oss")
    with ServerThread(create_app(engine, ServerArgs(api_key="sk-h"))) as srv:
        yield srv


def test_through_the_server_with_both_parsers(harmony_server):
    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="sk-h", timeout=60,
                           max_retries=0)
    kw = {"model": "fake-model", "max_tokens": 400, "stop": ["END"], "tools": [WEATHER],
          "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    c = client.chat.completions.create(**kw).choices[0]
    assert c.message.model_extra["reasoning_content"] == "Need the weather in Paris."
    assert c.message.content is None and c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, args, reasons = "", "", [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                if tc.id:
                    args.append(tc.function.arguments or "")
                    assert tc.function.name == "get_weather"
                else:
                    args[tc.index] += tc.function.arguments
            reasons.append(ch.finish_reason)
    assert reasoning == "Need the weather in Paris." and content == ""
    assert args == [call.function.arguments] and reasons[-1] == "tool_calls"
    assert not any(m in reasoning + content for m in ("<|", "|>"))
