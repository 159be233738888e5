"""A table of bad requests against one running server (fake engine): each gets its 4xx in OpenAI's
error shape, never a 500, and a normal request succeeds right after it."""

from __future__ import annotations

import json

import pytest

from conformance.server_kit import FakeEngine, ServerThread, http_request
from core.plan.args import ServerArgs
from core.server.app import create_app
from core.server.state import STATE

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024  # --max-request-bytes for this server
CONTEXT = 256  # the fake engine's context length

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"


def chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


def comp(**kw):
    return {"prompt": "hi", **kw}


# (case id, path, body (bytes / str sent as is, else JSON), extra headers, status, param, code)
# param "" means "do not check"; None means the error must name no parameter.
CASES = [
    ("malformed-json", C, b'{"prompt": ', {}, 400, None, "invalid_json"),
    ("json-array", C, b"[1, 2]", {}, 400, None, "invalid_json"),
    ("json-string", C, b'"hi"', {}, 400, None, "invalid_json"),
    ("json-null", C, b"null", {}, 400, None, "invalid_json"),
    ("empty-body", C, b"", {}, 400, None, "invalid_json"),
    ("not-utf8", C, b'{"prompt": "\xff\xfe"}', {}, 400, None, "invalid_json"),
    ("nested-30k", C, b"[" * 30_000 + b"]" * 30_000, {}, 400, None, "invalid_json"),
    ("int-5000-digits", C, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400,
     None, "invalid_json"),
    ("max_tokens-NaN", C, b'{"prompt": "hi", "max_tokens": NaN}', {}, 400, "max_tokens", ""),
    ("temperature-NaN", C, b'{"prompt": "hi", "temperature": NaN}', {}, 400, "temperature", ""),
    ("temperature-Infinity", CH, b'{"messages": [{"role": "user", "content": "x"}], '
     b'"temperature": Infinity}', {}, 400, "temperature", ""),
    ("temperature-1e400", C, b'{"prompt": "hi", "temperature": 1e400}', {}, 400, "temperature",
     ""),
    ("temperature-negative", C, comp(temperature=-1), {}, 400, "temperature", ""),
    ("temperature-string", C, comp(temperature="hot"), {}, 400, "temperature", "invalid_type"),
    ("top_p-too-big", CH, chat(top_p=1.5), {}, 400, "top_p", ""),
    ("frequency_penalty-3", C, comp(frequency_penalty=3), {}, 400, "frequency_penalty", ""),
    ("max_tokens-negative", C, comp(max_tokens=-5), {}, 400, "max_tokens", ""),
    ("max_tokens-zero", CH, chat(max_tokens=0), {}, 400, "max_tokens", ""),
    ("max_tokens-huge", C, comp(max_tokens=10**12), {}, 400, "max_tokens", ""),
    ("max_tokens-bool", C, comp(max_tokens=True), {}, 400, "max_tokens", "invalid_type"),
    ("max_tokens-fraction", C, comp(max_tokens=1.5), {}, 400, "max_tokens", "invalid_type"),
    ("n-zero", C, comp(n=0), {}, 400, "n", ""),
    ("n-huge", CH, chat(n=10**9), {}, 400, "n", ""),
    ("logprobs-over-cap", C, comp(logprobs=100), {}, 400, "logprobs", ""),
    ("top_logprobs-without-logprobs", CH, chat(top_logprobs=3), {}, 400, "top_logprobs", ""),
    ("stop-too-many", C, comp(stop=[f"s{i}" for i in range(100)]), {}, 400, "stop", ""),
    ("stop-empty-string", C, comp(stop=[""]), {}, 400, "stop", ""),
    ("stop-wrong-type", CH, chat(stop=5), {}, 400, "stop", "invalid_type"),
    ("stop-too-long", C, comp(stop=["x" * 10_000]), {}, 400, "stop", ""),
    ("seed-below-int64", C, comp(seed=-(2**63) - 1), {}, 400, "seed", ""),
    ("seed-2^63", C, comp(seed=2**63), {}, 400, "seed", ""),
    ("stream-not-bool", C, comp(stream="yes"), {}, 400, "stream", "invalid_type"),
    ("stream_options-without-stream", CH, chat(stream_options={"include_usage": True}), {}, 400,
     "stream_options", ""),
    ("top_k-zero-engine-rule", C, comp(top_k=0), {}, 400, "top_k", ""),
    ("logit_bias-over-100", C, comp(logit_bias={"5": 500}), {}, 400, "logit_bias.5", ""),
    ("logit_bias-not-a-token-id", C, comp(logit_bias={"five": 1}), {}, 400, "logit_bias", ""),
    ("logit_bias-outside-vocab", C, comp(logit_bias={"99999999": 1}), {}, 400, "logit_bias",
     ""),
    ("logit_bias-not-an-object", C, comp(logit_bias=[5]), {}, 400, "logit_bias",
     "invalid_type"),
    ("logprob_start_len-without-return_logprob", "/generate",
     {"text": "hi", "logprob_start_len": 0}, {}, 400, "logprob_start_len", ""),
    ("tools-function-missing", CH, chat(tools=[{"type": "function"}]), {}, 400,
     "tools[0].function", "missing_required_parameter"),
    ("best_of-not-n", C, comp(best_of=3), {}, 400, "best_of", "unsupported"),
    ("prompt-missing", C, {"max_tokens": 3}, {}, 400, "prompt", "missing_required_parameter"),
    ("prompt-number", C, {"prompt": 123}, {}, 400, "prompt", "invalid_type"),
    ("prompt-empty-array", C, {"prompt": []}, {}, 400, "prompt", ""),
    ("prompt-empty-string", C, {"prompt": ""}, {}, 400, "prompt", ""),
    ("prompt-token-out-of-vocab", C, {"prompt": [5, 999_999]}, {}, 400, "prompt", ""),
    ("prompt-token-negative", C, {"prompt": [-1]}, {}, 400, "prompt", ""),
    ("prompt-lone-surrogate", C, b'{"prompt": "a\\ud800b"}', {}, 400, "prompt", ""),
    ("prompt-longer-than-context", C, {"prompt": "x" * 300}, {}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt-plus-max_tokens-over-context", C, {"prompt": "x" * 200, "max_tokens": 100}, {},
     400, "max_tokens", "context_length_exceeded"),
    ("messages-missing", CH, {"max_tokens": 3}, {}, 400, "messages",
     "missing_required_parameter"),
    ("messages-empty", CH, {"messages": []}, {}, 400, "messages", ""),
    ("messages-string", CH, {"messages": "hello"}, {}, 400, "messages", "invalid_type"),
    ("message-not-object", CH, {"messages": ["hello"]}, {}, 400, "messages[0]", "invalid_type"),
    ("message-unknown-role", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400,
     "messages[0].role", ""),
    ("message-role-missing", CH, {"messages": [{"content": "hi"}]}, {}, 400, "messages[0].role",
     ""),
    ("message-content-number", CH, {"messages": [{"role": "user", "content": 5}]}, {}, 400,
     "messages[0].content", "invalid_type"),
    ("message-content-null", CH, {"messages": [{"role": "user", "content": None}]}, {}, 400,
     "messages[0].content", "invalid_type"),
    ("message-image-part", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, {}, 400,
     "messages[0].content[0]", ""),
    ("chat-template-refuses", CH, {"messages": [{"role": "user", "content": "a"},
                                                {"role": "system", "content": "b"}]}, {}, 400,
     "messages", "chat_template_error"),
    ("unknown-model", CH, chat(model="gpt-9"), {}, 404, "model", "model_not_found"),
    ("model-not-string", C, comp(model=7), {}, 400, "model", "invalid_type"),
    ("generate-text-and-ids", G, {"text": "a", "input_ids": [5]}, {}, 400, "text", ""),
    ("generate-neither", G, {"sampling_params": {}}, {}, 400, "text", ""),
    ("generate-unknown-sampling-key", G, {"text": "a", "sampling_params": {"temprature": 1}},
     {}, 400, "sampling_params.temprature", "unsupported"),
    ("generate-sampling-not-object", G, {"text": "a", "sampling_params": "greedy"}, {}, 400,
     "sampling_params", "invalid_type"),
    ("generate-max_new_tokens-negative", G, {"text": "a", "sampling_params":
                                             {"max_new_tokens": -1}}, {}, 400,
     "sampling_params.max_new_tokens", ""),
    ("generate-ids-not-ints", G, {"input_ids": ["a"]}, {}, 400, "input_ids", "invalid_type"),
    ("body-over-limit", C, {"prompt": "x" * (LIMIT + 10)}, {}, 413, None, "request_too_large"),
    ("body-over-limit-chunked", C, {"prompt": "x" * (4 * LIMIT)},
     {"Transfer-Encoding": "chunked"}, 413, None, "request_too_large"),
    ("no-api-key", C, comp(), {"Authorization": None}, 401, None, "missing_api_key"),
    ("wrong-api-key", C, comp(), {"Authorization": "Bearer sk-wrong"}, 401, None,
     "invalid_api_key"),
    ("non-ascii-api-key", C, comp(), {"Authorization": "Bearer clé-ünïcødé".encode()}, 401,
     None, "invalid_api_key"),
    ("latin1-api-key-bytes", CH, chat(), {"Authorization": b"Bearer \xe9\xff"}, 401, None,
     "invalid_api_key"),
    ("basic-auth-scheme", C, comp(), {"Authorization": f"Basic {KEY}"}, 401, None,
     "missing_api_key"),
    ("key-prefix-only", C, comp(), {"Authorization": f"Bearer {KEY[:-1]}"}, 401, None,
     "invalid_api_key"),
    ("unknown-route", "/v1/nothing", comp(), {}, 404, None, "route_not_found"),
    ("wrong-method", "/v1/models", comp(), {}, 405, None, "method_not_allowed"),
]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(context_length=CONTEXT)
    args = ServerArgs(api_key=KEY, max_request_bytes=LIMIT)
    with ServerThread(create_app(engine, args)) as srv:
        yield srv


def test_table_is_big_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def _good_request(srv) -> None:
    status, _, raw = http_request(srv.url, "POST", C, {"prompt": "hi", "max_tokens": 5},
                                  AUTH, timeout=10)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == "hello"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_then_server_still_serves(server, case):
    _, path, body, extra, status, param, code = case
    method = "GET" if case[0] == "wrong-method" else "POST"
    if case[0] == "wrong-method":
        method, body = "DELETE", None
    headers = {**AUTH, **extra}
    headers = {k: v for k, v in headers.items() if v is not None}
    got, hdrs, raw = http_request(server.url, method, path, body, headers, timeout=10)
    assert got == status, raw[:500]
    assert hdrs["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "":
        assert err["param"] == param, err
    if code:
        assert err["code"] == code, err
    _good_request(server)


def test_context_error_gives_both_numbers(server):
    status, _, raw = http_request(server.url, "POST", C, {"prompt": "x" * 300}, AUTH)
    msg = json.loads(raw)["error"]["message"]
    assert status == 400 and "300" in msg and str(CONTEXT) in msg
    status, _, raw = http_request(server.url, "POST", C, {"prompt": "x" * 200,
                                                          "max_tokens": 100}, AUTH)
    msg = json.loads(raw)["error"]["message"]
    assert status == 400 and "200" in msg and "100" in msg and str(CONTEXT) in msg


def test_caps_are_checked_before_tokenizing(server):
    # a body that would take the tokenizer a while, with a bad n: rejected on the cap alone
    before = server.call(lambda: len(server.app[STATE].engine.submitted))
    status, _, raw = http_request(server.url, "POST", C, {"prompt": "x" * 50_000, "n": 999},
                                  AUTH)
    assert status == 400 and json.loads(raw)["error"]["param"] == "n"
    assert server.call(lambda: len(server.app[STATE].engine.submitted)) == before


def test_no_server_errors_were_counted(server):
    assert http_request(server.url, "POST", C, {"prompt": 5}, AUTH)[0] == 400
    status, _, raw = http_request(server.url, "GET", "/metrics", None, {})
    text = raw.decode()
    assert status == 200
    assert 'outcome="client_error"' in text
    assert 'outcome="server_error"' not in text
