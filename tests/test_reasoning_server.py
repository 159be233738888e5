"""reasoning_content through the server on the fake engine (conformance.server_kit), with the
official `openai` client and raw HTTP: non-streamed and streamed chat under deepseek-r1 and
qwen3, the streamed deltas joining to the message, no marker leaking; separate_reasoning,
stream_reasoning and chat_template_kwargs (enable_thinking false: all content); reasoning split
before tool calls; the fields refused where they cannot act. The parsers themselves:
tests/test_reasoning_parsers.py."""

from __future__ import annotations

import json

import openai
import pytest

from conformance.server_kit import FakeEngine, ServerThread, http_request
from core.plan.args import ServerArgs

KEY = "sk-reason"
R1_REPLY = "<think>\nLet me think: 2 + 2 = 4 ✓.\n</think>\n\nThe answer is 4.END"
QWEN_REPLY = ("<think>\nThe user wants the weather.\n</think>\n\nChecking.<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>END')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def _server(**kw):
    from core.server.app import create_app

    return ServerThread(create_app(FakeEngine(context_length=4096, **kw), ServerArgs(api_key=KEY)))


@pytest.fixture(scope="module")
def r1():
    with _server(reply=R1_REPLY, reasoning_parser="deepseek-r1") as s:
        yield s


@pytest.fixture(scope="module")
def qwen():
    with _server(reply=QWEN_REPLY, reasoning_parser="qwen3", tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def plain():
    with _server(reply=R1_REPLY) as s:
        yield s


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _chat(srv, **kw):
    return _client(srv).chat.completions.create(model="fake-model", max_tokens=400,
                                                stop=["END"], **kw)


def _streamed(srv, **kw) -> tuple[list[str], list[str], list[dict], list]:
    reasoning, content, calls, reasons = [], [], [], []
    for chunk in _chat(srv, stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning.append(extra["reasoning_content"])
            if c.delta.content:
                content.append(c.delta.content)
            for tc in c.delta.tool_calls or ():
                if tc.id:
                    calls.append({"name": tc.function.name, "arguments": ""})
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments
            reasons.append(c.finish_reason)
    return reasoning, content, calls, reasons


def _leaks(parts: list[str]) -> bool:
    return any(m in p for p in parts for m in ("<think>", "</think>", "<think", "think>"))


def test_deepseek_r1_message_carries_reasoning_content(r1):
    m = _chat(r1, messages=ASK).choices[0].message
    assert m.model_extra["reasoning_content"] == "Let me think: 2 + 2 = 4 ✓.\n"
    assert m.content == "The answer is 4."


def test_deepseek_r1_stream_joins_to_the_message(r1):
    reasoning, content, _, reasons = _streamed(r1, messages=ASK)
    assert "".join(reasoning) == "Let me think: 2 + 2 = 4 ✓.\n"
    assert "".join(content) == "The answer is 4."
    assert len(reasoning) > 1  # streamed as it comes (the fake engine sends a character a step)
    assert not _leaks(reasoning + content) and reasons[-1] == "stop"


def test_separate_reasoning_false_leaves_the_output_as_written(r1):
    m = _chat(r1, messages=ASK, extra_body={"separate_reasoning": False}).choices[0].message
    assert m.content == R1_REPLY.removesuffix("END")
    assert "reasoning_content" not in (m.model_extra or {})
    _, content, _, _ = _streamed(r1, messages=ASK, extra_body={"separate_reasoning": False})
    assert "".join(content) == R1_REPLY.removesuffix("END")


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta(r1):
    reasoning, content, _, _ = _streamed(r1, messages=ASK,
                                         extra_body={"stream_reasoning": False})
    assert reasoning == ["Let me think: 2 + 2 = 4 ✓.\n"]
    assert "".join(content) == "The answer is 4."


def test_reasoning_cut_off_by_max_tokens_is_all_reasoning(r1):
    r = _client(r1).chat.completions.create(model="fake-model", messages=ASK, max_tokens=20)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert m.model_extra["reasoning_content"] == R1_REPLY[8:20]
    assert m.content is None


def test_qwen3_reasoning_then_tool_calls(qwen):
    c = _chat(qwen, messages=ASK, tools=[WEATHER]).choices[0]
    assert c.message.model_extra["reasoning_content"] == "The user wants the weather.\n"
    assert c.message.content == "Checking." and c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls, reasons = _streamed(qwen, messages=ASK, tools=[WEATHER])
    assert "".join(reasoning) == "The user wants the weather.\n"
    assert "".join(content) == "Checking." and not _leaks(reasoning + content)
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
    assert reasons[-1] == "tool_calls"


def test_qwen3_enable_thinking_false_is_all_content(qwen):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    m = _chat(qwen, messages=ASK, extra_body=off).choices[0].message
    assert m.model_extra.get("reasoning_content") is None
    assert m.content == QWEN_REPLY.removesuffix("END")
    _, content, _, _ = _streamed(qwen, messages=ASK, extra_body=off)
    assert "".join(content) == QWEN_REPLY.removesuffix("END")
    # the kwarg reached the chat template: it closed an empty think block in the prompt
    from core.server.state import STATE

    sent = qwen.call(lambda: qwen.app[STATE].engine.submitted[-1].input_ids)
    assert bytes(i - 3 for i in sent).decode().endswith("<assistant><think>\n\n</think>\n\n")


def test_plain_text_without_markers_is_content_under_qwen3():
    with _server(reply="Just an answer.END", reasoning_parser="qwen3") as s:
        m = _chat(s, messages=ASK).choices[0].message
        assert m.content == "Just an answer." and m.model_extra["reasoning_content"] is None


def test_a_replayed_reasoning_content_is_taken(r1):
    msgs = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"},
            {"role": "user", "content": "And 3 + 3?"}]
    assert _chat(r1, messages=msgs).choices[0].message.content == "The answer is 4."


def _post(srv, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    status, _, raw = http_request(srv.url, "POST", path, body,
                                  {"Authorization": f"Bearer {KEY}"})
    return status, json.loads(raw)


@pytest.mark.parametrize("extra,param,words", [
    ({"separate_reasoning": True}, "separate_reasoning", "--reasoning-parser"),
    ({"stream_reasoning": False}, "stream_reasoning", "--reasoning-parser"),
    ({"separate_reasoning": "yes"}, "separate_reasoning", "true or false"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "itself"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs.bos_token", "itself"),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "variable name"),
    ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs", "at most"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(40)}}, "chat_template_kwargs",
     "at most"),
    ({"chat_template_kwargs": {"note": "<|eos|>"}}, "chat_template_kwargs", "special token"),
])
def test_fields_refused_where_they_cannot_act(plain, extra, param, words):
    status, body = _post(plain, {"messages": ASK, "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_fields_that_ask_for_nothing_are_taken_without_a_parser(plain):
    for extra in ({"separate_reasoning": False}, {"stream_reasoning": True},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        status, body = _post(plain, {"messages": ASK, "max_tokens": 4, **extra})
        assert status == 200, (extra, body)
        assert "reasoning_content" not in body["choices"][0]["message"]


def test_enable_thinking_must_be_a_boolean(qwen):
    status, body = _post(qwen, {"messages": ASK, "max_tokens": 4,
                                "chat_template_kwargs": {"enable_thinking": "no"}})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs.enable_thinking"


def test_completions_refuse_the_chat_fields(r1):
    status, body = _post(r1, {"prompt": "hi", "max_tokens": 4, "separate_reasoning": True},
                         "/v1/completions")
    assert status == 400 and body["error"]["code"] == "unsupported"


def test_reasoning_content_only_on_assistant_messages(r1):
    msgs = [{"role": "user", "content": "hi", "reasoning_content": "no"}]
    status, body = _post(r1, {"messages": msgs, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "messages[0].reasoning_content"
