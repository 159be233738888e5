"""The server's routes and behaviour on a deterministic fake engine (no model; fast).

The fake's greedy reply is "hello world " repeated, one byte per token; see conformance.server_kit.
"""

from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest
from aiohttp import web

from conformance.server_kit import (
    FakeEngine,
    ServerThread,
    http_request,
    read_first_chunk,
    send_stream_request,
    sse_payloads,
)
from core.plan.args import ServerArgs
from core.server.app import create_app
from core.server.auth import PUBLIC_ROUTES
from core.server.state import STATE

KEY = "sk-api"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(engine: FakeEngine | None = None, **args) -> ServerThread:
    engine = engine or FakeEngine()
    args.setdefault("api_key", KEY)
    return ServerThread(create_app(engine, ServerArgs(**args)))


def post(srv, path, body, headers=AUTH, timeout=10.0):
    status, hdrs, raw = http_request(srv.url, "POST", path, body, headers, timeout=timeout)
    return status, hdrs, raw


def get(srv, path, headers=AUTH):
    return http_request(srv.url, "GET", path, None, headers, timeout=10)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=10, max_retries=0)


def engine_of(srv) -> FakeEngine:
    return srv.app[STATE].engine


def wait_until(pred, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture(scope="module")
def srv():
    with start(enable_cache_report=True) as s:
        yield s


# -- the OpenAI routes through the official client -----------------------------------------------

def test_completion_and_usage(srv):
    r = client(srv).completions.create(model="fake-model", prompt="abc", max_tokens=5)
    assert r.choices[0].text == "hello"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_completion_stream(srv):
    chunks = list(client(srv).completions.create(model="fake-model", prompt="abc", max_tokens=7,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hello w"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_and_stream_agree(srv):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client(srv).chat.completions.create(model="fake-model", messages=msgs, max_tokens=8)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == "hello wo"
    stream = list(client(srv).chat.completions.create(
        model="fake-model", messages=msgs, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 8
    assert stream[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_is_sse_ending_in_done(srv):
    status, hdrs, raw = post(srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True})
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = sse_payloads(raw)
    assert events[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    assert all(isinstance(e, dict) and e["object"] == "chat.completion.chunk"
               for e in events[:-1])


def test_model_omitted_is_the_served_model(srv):
    status, _, raw = post(srv, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["model"] == "fake-model"


def test_n_and_batch_prompts_are_indexed(srv):
    r = client(srv).completions.create(model="fake-model", prompt=["a", "bb"], n=2, max_tokens=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3  # each prompt once, not once per choice
    assert r.usage.completion_tokens == 8
    seeds = [g.sampling.get("seed") for g in engine_of(srv).submitted[-4:]]
    assert seeds == [None] * 4
    client(srv).completions.create(model="fake-model", prompt="a", n=3, seed=7, max_tokens=1)
    assert [g.sampling["seed"] for g in engine_of(srv).submitted[-3:]] == [7, 8, 9]


def test_token_id_prompts_and_echo(srv):
    ids = [ord(c) + 3 for c in "xyz"]
    r = client(srv).completions.create(model="fake-model", prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text == "xyzhe"
    assert list(engine_of(srv).submitted[-1].input_ids) == ids


def test_stop_string(srv):
    r = client(srv).completions.create(model="fake-model", prompt="a", max_tokens=20,
                                       stop=["wor"])
    assert r.choices[0].text == "hello "
    assert r.choices[0].finish_reason == "stop"


def test_parameters_reach_the_engine_in_sglang_names(srv):
    client(srv).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "q"}], max_completion_tokens=4,
        temperature=0.5, top_p=0.9, frequency_penalty=0.1, presence_penalty=0.2, seed=3,
        stop="zz", extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                               "min_tokens": 2, "ignore_eos": True})
    s = engine_of(srv).submitted[-1].sampling
    assert s == {"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9, "frequency_penalty": 0.1,
                 "presence_penalty": 0.2, "seed": 3, "stop": ["zz"], "top_k": 5, "min_p": 0.1,
                 "repetition_penalty": 1.1, "min_new_tokens": 2, "ignore_eos": True}


def test_default_max_tokens_per_route(srv):
    client(srv).completions.create(model="fake-model", prompt="abcd")
    assert engine_of(srv).submitted[-1].sampling["max_new_tokens"] == 16  # OpenAI's default
    post(srv, "/generate", {"text": "abcd"})
    assert engine_of(srv).submitted[-1].sampling["max_new_tokens"] == 128  # SGLang's
    # chat: the rest of the context (the fake's is 256)
    client(srv).chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "q"}], stop=["o"])
    gr = engine_of(srv).submitted[-1]
    assert gr.sampling["max_new_tokens"] == 256 - len(gr.input_ids)


def test_logprobs_shapes(srv):
    r = client(srv).completions.create(model="fake-model", prompt="a", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["h", "e", "l"] and lp.token_logprobs == [-0.25] * 3
    assert lp.text_offset == [0, 1, 2] and len(lp.top_logprobs[0]) == 2
    c = client(srv).chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "q"}], max_tokens=2, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert [t.token for t in content] == ["h", "e"]
    assert content[0].bytes == [ord("h")] and len(content[0].top_logprobs) == 3


def test_cache_report(srv):
    prompt = "the same long prompt, " * 3
    client(srv).completions.create(model="fake-model", prompt=prompt, max_tokens=1)
    r = client(srv).completions.create(model="fake-model", prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_no_cache_report_without_the_flag():
    with start() as s:
        status, _, raw = post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 200 and "prompt_tokens_details" not in json.loads(raw)["usage"]


def test_served_model_name():
    with start(served_model_name="my-llm") as s:
        assert client(s).models.list().data[0].id == "my-llm"
        assert client(s).completions.create(model="my-llm", prompt="a", max_tokens=1).model \
            == "my-llm"
        with pytest.raises(openai.NotFoundError):
            client(s).completions.create(model="fake-model", prompt="a", max_tokens=1)


# -- the native route ---------------------------------------------------------------------------

def test_generate_text_ids_batch(srv):
    status, _, raw = post(srv, "/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})
    out = json.loads(raw)
    assert status == 200 and out["text"] == "hell" and len(out["output_ids"]) == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert out["meta_info"]["prompt_tokens"] == 1 and out["meta_info"]["completion_tokens"] == 4
    status, _, raw = post(srv, "/generate", {"input_ids": [[100, 101], [102]],
                                             "sampling_params": {"max_new_tokens": 2}})
    outs = json.loads(raw)
    assert status == 200 and [o["text"] for o in outs] == ["he", "he"]
    status, _, raw = post(srv, "/generate", {"text": "a", "rid": "my-rid",
                                             "sampling_params": {"max_new_tokens": 1}})
    assert json.loads(raw)["meta_info"]["id"] == "my-rid"


def test_generate_stream_is_cumulative(srv):
    status, _, raw = post(srv, "/generate", {"text": "a", "stream": True,
                                             "sampling_params": {"max_new_tokens": 3}})
    events = sse_payloads(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["text"] for e in events[:-1]] == ["h", "he", "hel"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


# -- info routes --------------------------------------------------------------------------------

def test_models_and_info(srv):
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client(srv).models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client(srv).models.retrieve("nope")
    status, _, raw = get(srv, "/get_model_info")
    info = json.loads(raw)
    assert status == 200 and info["context_length"] == 256 and info["is_generation"] is True
    status, _, raw = get(srv, "/get_server_info")
    info = json.loads(raw)
    assert status == 200
    assert info["plan"]["decode_attention"] == "fake"
    assert info["candidates"][0]["chosen"] is True
    assert info["server_args"]["api_key"] == "<redacted>" and KEY not in raw.decode()
    assert info["stats"]["kv_pages_total"] == 4096 and "plan_table" in info


def test_openapi_documents_every_route(srv):
    status, _, raw = get(srv, "/openapi.json")
    spec = json.loads(raw)
    routes = {r.resource.canonical for r in srv.app.router.routes()}
    assert status == 200 and spec["openapi"].startswith("3.")
    assert routes == set(spec["paths"])


PROM_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})?'
                       r" (-?[0-9.e+-]+|\+Inf|NaN)$")


def test_metrics_prometheus_text(srv):
    client(srv).completions.create(model="fake-model", prompt="a", max_tokens=3)
    post(srv, "/v1/completions", {"prompt": 5})
    status, hdrs, raw = get(srv, "/metrics", headers={})
    text = raw.decode()
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or PROM_LINE.match(line), \
            line
    assert re.search(r'core_requests_total\{endpoint="/v1/completions",outcome="success"\} \d+',
                     text)
    assert 'core_requests_total{endpoint="/v1/completions",outcome="client_error"}' in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        count = re.search(rf"core_{name}_count (\d+)", text)
        assert count and int(count.group(1)) > 0
        assert f'core_{name}_bucket{{le="+Inf"}} {count.group(1)}' in text
    for gauge in ("num_running_reqs", "num_queued_reqs", "kv_pages_used", "kv_pages_total",
                  "prefix_cache_hit_rate"):
        assert re.search(rf"^core_{gauge} [0-9.]+$", text, re.M), gauge


# -- auth ---------------------------------------------------------------------------------------

def test_every_route_but_the_public_ones_needs_the_key(srv):
    for route in srv.app.router.routes():
        path = route.resource.canonical.replace("{model}", "fake-model")
        status, _, raw = http_request(srv.url, route.method, path, b"{}", {}, timeout=10)
        if route.resource.canonical in PUBLIC_ROUTES:
            assert status == 200, path
        else:
            assert status == 401, (route.method, path)
            if route.method != "HEAD":  # HEAD answers carry no body
                assert json.loads(raw)["error"]["type"] == "authentication_error"


def test_new_routes_are_guarded_by_default():
    app = create_app(FakeEngine(), ServerArgs(api_key=KEY))

    async def secret(request):
        return web.json_response({"secret": 42})

    app.router.add_get("/debug/secret", secret)
    with ServerThread(app) as s:
        assert get(s, "/debug/secret", headers={})[0] == 401
        assert get(s, "/debug/secret")[0] == 200
        # a path that normalises to a public route does not bypass the check
        assert get(s, "/health/../debug/secret", headers={})[0] in (401, 404)


def test_no_key_configured_means_open():
    with ServerThread(create_app(FakeEngine(), ServerArgs())) as s:
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers={})[0] == 200


# -- faults -------------------------------------------------------------------------------------

def _open_stream(srv, body, path="/v1/completions") -> socket.socket:
    """Send a streaming request on a raw socket and read until the first data chunk."""
    sock = send_stream_request(srv.port, body, KEY, path)
    read_first_chunk(sock)
    return sock


def test_client_disconnect_aborts_and_frees_kv():
    eng = FakeEngine(token_delay=0.02)
    with start(eng) as s:
        idle = s.call(eng.pages_in_use)
        socks = [_open_stream(s, {"prompt": f"p{i}", "max_tokens": 200, "stream": True})
                 for i in range(8)]
        assert s.call(lambda: len(eng.active)) == 8 and s.call(eng.pages_in_use) > idle
        for sock in socks:
            sock.close()
        assert wait_until(lambda: s.call(lambda: len(eng.active)) == 0)
        assert s.call(eng.pages_in_use) == idle
        assert s.call(lambda: len(eng.aborted)) == 8 and eng.finished == 0
        # a non-streaming request whose client leaves is aborted too
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        payload = json.dumps({"prompt": "q", "max_tokens": 200}).encode()
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert wait_until(lambda: s.call(lambda: len(eng.active)) == 1)
        sock.close()
        assert wait_until(lambda: s.call(lambda: len(eng.active)) == 0)
        assert s.call(lambda: len(eng.aborted)) == 9
        text = get(s, "/metrics")[2].decode()
        assert 'core_requests_total{endpoint="/v1/completions",outcome="aborted"} 9' in text


def test_engine_failure_fails_alone():
    eng = FakeEngine(token_delay=0.01)
    with start(eng) as s:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            good = pool.submit(post, s, "/v1/completions", {"prompt": "fine", "max_tokens": 30})
            bad_stream = pool.submit(post, s, "/v1/completions", {
                "prompt": "FAIL_EVENT", "max_tokens": 30, "stream": True})
            bad_raise = pool.submit(post, s, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "FAIL_RAISE"}], "max_tokens": 30})
            status, _, raw = good.result(20)
            assert status == 200 and json.loads(raw)["choices"][0]["text"].startswith("hello")
            status, _, raw = bad_stream.result(20)
            events = sse_payloads(raw)
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "engine_error"
            assert events[0]["choices"][0]["text"] == "h"  # it had started fine
            status, _, raw = bad_raise.result(20)
            assert status == 500 and "simulated kernel failure" in \
                json.loads(raw)["error"]["message"]
        assert post(s, "/v1/completions", {"prompt": "after", "max_tokens": 2})[0] == 200
        assert s.call(lambda: len(eng.active)) == 0


def test_a_broken_engine_delta_ends_the_stream_cleanly():
    with start() as s:
        status, _, raw = post(s, "/v1/completions", {"prompt": "MALFORMED", "max_tokens": 5,
                                                     "stream": True, "logprobs": 1})
        events = sse_payloads(raw)
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "internal_error"
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
        assert wait_until(lambda: s.call(lambda: len(engine_of(s).active)) == 0)


def test_queue_full_is_503_with_retry_after():
    eng = FakeEngine(token_delay=0.05, max_active=1)
    with start(eng) as s:
        sock = _open_stream(s, {"prompt": "long", "max_tokens": 100, "stream": True})
        for body in ({"prompt": "x", "max_tokens": 1},
                     {"prompt": "x", "max_tokens": 1, "stream": True}):
            status, hdrs, raw = post(s, "/v1/completions", body)
            assert status == 503 and int(hdrs["retry-after"]) >= 1
            assert json.loads(raw)["error"]["code"] == "queue_full"
        sock.close()
        assert wait_until(lambda: s.call(lambda: len(eng.active)) == 0)
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_server_side_admission_limit():
    eng = FakeEngine(token_delay=0.05)
    with start(eng, max_running_requests=1, max_queued_requests=1) as s:
        socks = [_open_stream(s, {"prompt": "l", "max_tokens": 100, "stream": True})
                 for _ in range(2)]
        status, hdrs, _ = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 503 and "retry-after" in hdrs
        for sock in socks:
            sock.close()
        assert wait_until(lambda: post(s, "/v1/completions", {"prompt": "x",
                                                              "max_tokens": 1})[0] == 200)


def test_health_reflects_the_engine():
    eng = FakeEngine()
    with start(eng) as s:
        s.app[STATE].health_timeout = 0.2
        assert get(s, "/health", headers={})[0] == 200
        assert get(s, "/health_generate")[0] == 200  # needs the key (issue 16, item 6)
        eng.alive = False
        assert get(s, "/health", headers={})[0] == 503
        assert get(s, "/health_generate")[0] == 503
        assert "core_engine_up 0" in get(s, "/metrics", headers={})[2].decode()
        eng.alive, eng.wedged = True, True
        assert get(s, "/health", headers={})[0] == 503  # wedged: no answer within the timeout
        eng.wedged = False
        assert get(s, "/health", headers={})[0] == 200


def test_draining_refuses_new_work():
    with start() as s:
        s.app[STATE].draining = True
        status, hdrs, raw = post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
        assert "retry-after" in hdrs
        assert get(s, "/health", headers={})[0] == 503


def test_64_concurrent_streams():
    eng = FakeEngine(token_delay=0.001)
    with start(eng) as s:
        import concurrent.futures

        body = {"prompt": "c", "max_tokens": 20, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda _: post(s, "/v1/completions", body, timeout=30),
                                    range(64)))
        for status, _, raw in results:
            events = sse_payloads(raw)
            assert status == 200 and events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
                ("hello world " * 2)[:20]
        assert s.call(lambda: len(eng.active)) == 0


def test_log_requests(caplog):
    caplog.set_level("INFO", logger="core.server")
    with start(log_requests=True) as s:
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
    text = caplog.text
    assert "completions prompt_tokens=[1]" in text
    assert "reason=length prompt_tokens=1 completion_tokens=2" in text
