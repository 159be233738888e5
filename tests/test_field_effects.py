"""No request field is accepted and ignored: every field each generation route takes
(core.server.protocol.ROUTE_FIELDS) is sent with a value that asks for something, and what reaches
the engine (the GenRequests: prompt ids, sampling, logprobs) or the response must differ from the
same request without it, or the request is refused with a 4xx naming the field. A field added to
a route without a row here fails `test_the_table_covers_every_field`.

On the fake engine (byte-level tokenizer, a fixed reply); it refuses what it could not do
(logit_bias, structured-output constraints: never ignored there either). Their effect on the real
engine: tests/test_server_engine.py (logit_bias, prompt logprobs, echo), tests/test_grammar_server.py
(constraints), tests/test_tools_server.py (tools).
"""

from __future__ import annotations

import json

import pytest

from conformance.server_kit import FakeEngine, ServerThread, http_request
from core.plan.args import ServerArgs
from core.server import protocol
from core.server.app import create_app
from core.server.state import STATE

KEY = "sk-fields"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# field -> (what the base request also carries, the field's own value); the base of each route
# is BASE[route]
BASE = {"completions": {"prompt": "hello", "max_tokens": 4},
        "chat": {"messages": MSG, "max_tokens": 4},
        "generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}}}
COMMON = {
    "model": ({}, "not-this-model"), "stream": ({}, True),
    "stream_options": ({"stream": True}, {"include_usage": True}), "n": ({}, 2),
    "best_of": ({}, 3), "temperature": ({}, 0.5), "top_p": ({}, 0.5), "top_k": ({}, 5),
    "min_p": ({}, 0.1), "frequency_penalty": ({}, 1.0), "presence_penalty": ({}, 1.0),
    "repetition_penalty": ({}, 1.2), "seed": ({}, 7), "stop": ({}, ["xyz"]),
    "stop_token_ids": ({}, [5]), "ignore_eos": ({}, True), "skip_special_tokens": ({}, False),
    "max_tokens": ({}, 2), "min_tokens": ({}, 1), "logit_bias": ({}, {"5": 10}),
    "logprobs": ({}, 1), "prompt_logprobs": ({}, 1), "return_token_ids": ({}, True),
    "response_format": ({}, {"type": "json_object"}), "regex": ({}, "a+"),
    "ebnf": ({}, 'root ::= "a"'), "json_schema": ({}, {"type": "object"}),
    "guided_json": ({}, {"type": "object"}), "guided_regex": ({}, "a+"),
    "guided_choice": ({}, ["a", "b"]), "guided_grammar": ({}, 'root ::= "a"'),
    "structured_outputs": ({}, {"regex": "a+"}),
}
TABLE = {
    "completions": {**COMMON, "prompt": ({}, "other words"), "echo": ({}, True)},
    "chat": {**COMMON, "logprobs": ({}, True), "top_logprobs": ({"logprobs": True}, 2),
             "max_completion_tokens": ({}, 2), "add_generation_prompt": ({}, False),
             "messages": ({}, [{"role": "user", "content": "other words"}]),
             "tools": ({}, [TOOL]), "tool_choice": ({"tools": [TOOL]}, "required"),
             "parallel_tool_calls": ({"tools": [TOOL]}, False),
             "separate_reasoning": ({}, False), "stream_reasoning": ({"stream": True}, False),
             "chat_template_kwargs": ({}, {"enable_thinking": False})},
    "generate": {"text": ({}, "other words"), "input_ids": ({"text": None, "input_ids": [104, 105]}, [72, 105]),
                 "sampling_params": ({}, {"max_new_tokens": 2}), "stream": ({}, True),
                 "rid": ({}, "my-own-rid"), "return_logprob": ({}, True),
                 "top_logprobs_num": ({"return_logprob": True}, 2),
                 "logprob_start_len": ({"return_logprob": True}, 0),
                 # on the fake engine LoRA is off: refused naming the field (its effect:
                 # tests/test_lora.py)
                 "lora_path": ({}, "an-adapter")},
}
# carried for the client's own bookkeeping, documented as such (OpenAI's end-user id)
HARMLESS = {"user"}
# rows that show their effect only on an answer with two tool calls (auto keeps one when
# parallel calls are off)
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "a"}}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "b"}}</tool_call>')
ON_TWO_CALLS = {("chat", "parallel_tool_calls")}
# rows that act on a server with a reasoning parser (without one, they are 400s or no-ops
# with the value that asks for nothing: tests/test_reasoning_server.py)
THINKS = "<think>\nfirst this, then that\n</think>\n\nthe answer"
ON_REASONING = {("chat", "separate_reasoning"), ("chat", "stream_reasoning"),
                ("chat", "chat_template_kwargs")}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "generate": "/generate"}


@pytest.fixture(scope="module")
def srv():
    # a tool-call parser, so that tools can be offered (the fake template never reads them)
    with ServerThread(create_app(FakeEngine(context_length=4096,
                                            tool_call_parser="hermes"),
                                 ServerArgs(api_key=KEY))) as s:
        yield s


@pytest.fixture(scope="module")
def srv_calls():
    with ServerThread(create_app(FakeEngine(context_length=4096, reply=TWO_CALLS,
                                            tool_call_parser="hermes"),
                                 ServerArgs(api_key=KEY))) as s:
        yield s


@pytest.fixture(scope="module")
def srv_reasoning():
    with ServerThread(create_app(FakeEngine(context_length=4096, reply=THINKS,
                                            reasoning_parser="qwen3"),
                                 ServerArgs(api_key=KEY))) as s:
        yield s


def _normal(raw: bytes) -> list:
    """The response without what differs between any two requests (ids, timestamps)."""
    text = raw.decode()
    docs = [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"] or [json.loads(text)]

    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ("id", "created")}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(docs)


def _send(srv, route: str, body: dict):
    engine = srv.app[STATE].engine
    before = srv.call(lambda: len(engine.submitted))
    status, _, raw = http_request(srv.url, "POST", PATHS[route], body, AUTH)
    gen = srv.call(lambda: [(g.input_ids, g.sampling, g.logprobs, g.top_logprobs)
                            for g in engine.submitted[before:]])
    return status, raw, gen


def test_the_table_covers_every_field():
    for route, fields in TABLE.items():
        harmless = HARMLESS & set(protocol.ROUTE_FIELDS[route])
        assert set(fields) | harmless == set(protocol.ROUTE_FIELDS[route]), route


@pytest.mark.parametrize("route,name", [(r, n) for r in TABLE for n in sorted(TABLE[r])])
def test_a_field_has_its_effect_or_is_refused(request, route, name):
    extra, value = TABLE[route][name]
    base = {k: v for k, v in {**BASE[route], **extra}.items() if v is not None}
    srv = request.getfixturevalue("srv")
    if (route, name) in ON_TWO_CALLS:
        srv = request.getfixturevalue("srv_calls")
        base["max_tokens"] = len(TWO_CALLS)
    if (route, name) in ON_REASONING:
        srv = request.getfixturevalue("srv_reasoning")
        base["max_tokens"] = len(THINKS)
    status0, raw0, gen0 = _send(srv, route, base)
    assert status0 == 200, raw0[:300]
    status, raw, gen = _send(srv, route, {**base, name: value})
    if status != 200:
        assert 400 <= status < 500, raw[:300]
        err = json.loads(raw)["error"]
        # the field itself, or the one it works with (tool_choice's constraint: tools)
        assert err["param"] and err["param"].split(".")[0].split("[")[0] in (name, *extra), err
        return
    assert (gen, _normal(raw)) != (gen0, _normal(raw0)), \
        f"{route}: {name}={value!r} was accepted and changed nothing"
