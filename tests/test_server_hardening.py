"""Reliability and security hardening of the server (issue 16) on the fake engine: request ids,
liveness vs readiness, API keys, admission, /health_generate, log injection, engine death,
transport (malformed HTTP, timeouts, keep-alive, Content-Type, headers). No model; fast."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import aiohttp
import pytest

from conformance.server_kit import (
    FakeEngine,
    ServerThread,
    http_request,
    read_first_chunk,
    send_stream_request,
    sse_payloads,
)
from core.messages import EngineInfo
from core.plan.args import ServerArgs, make_server_args
from core.server.app import create_app
from core.server.serve import EXIT_ENGINE_DIED, KEEPALIVE_S, is_loopback, run_server
from core.server.state import STATE

KEY = "sk-hard"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(engine: FakeEngine | None = None, runner_kw: dict | None = None, **args
          ) -> ServerThread:
    args.setdefault("api_key", KEY)
    return ServerThread(create_app(engine or FakeEngine(), ServerArgs(**args)),
                        **(runner_kw or {}))


def post(srv, path, body, headers=AUTH, timeout=10.0):
    return http_request(srv.url, "POST", path, body, headers, timeout=timeout)


def get(srv, path, headers=AUTH):
    return http_request(srv.url, "GET", path, None, headers, timeout=10)


def wait_until(pred, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def read_all(sock) -> bytes:
    buf = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return buf
        buf += part


def read_response(sock, buf: bytes = b"") -> bytes:
    """Read a chunked response to its end (the connection stays open: keep-alive)."""
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        part = sock.recv(65536)
        assert part, buf[-200:]
        buf += part
    return buf


def error_of(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. request ids ------------------------------------------------------------------------------

def test_rid_collision_is_400_and_leaves_the_request_in_flight():
    eng = FakeEngine(token_delay=0.01)
    with start(eng) as s:
        sock = send_stream_request(s.port, {"text": "a", "rid": "dup", "stream": True,
                                            "sampling_params": {"max_new_tokens": 60}},
                                   key=KEY, path="/generate")
        first = read_first_chunk(sock)
        status, _, raw = post(s, "/generate", {"text": "b", "rid": "dup",
                                               "sampling_params": {"max_new_tokens": 2}})
        assert status == 400 and error_of(raw)["code"] == "duplicate_rid"
        raw = read_response(sock, first)
        sock.close()
        last = [p for p in sse_payloads(_dechunk(raw)) if p != "[DONE]"][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length"  # not "abort"
        assert last["meta_info"]["id"] == "dup"
        assert not eng.aborted
        # free again once it finished
        status, _, raw = post(s, "/generate", {"text": "c", "rid": "dup",
                                               "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and json.loads(raw)["meta_info"]["id"] == "dup"


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    out = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + body[:n], body[n + 2:]
    return out


def test_rid_of_an_n_child_is_refused_and_untouched():
    eng = FakeEngine(token_delay=0.01)
    with start(eng) as s:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, s, "/generate", {
                "text": "a", "rid": "kid", "sampling_params": {"max_new_tokens": 40, "n": 2}})
            assert wait_until(lambda: s.call(lambda: len(eng.active)) == 2)
            for rid in ("kid-1", "kid-0", "kid"):
                status, _, raw = post(s, "/generate", {"text": "b", "rid": rid})
                assert status == 400 and error_of(raw)["code"] == "duplicate_rid", rid
            status, _, raw = fut.result(30)
        assert status == 200
        outs = json.loads(raw)
        assert [o["meta_info"]["id"] for o in outs] == ["kid-0", "kid-1"]
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert not eng.aborted


@pytest.mark.parametrize("rid", ["a\nINFO core.server: forged", "x" * 129, "", "a b", "é"])
def test_client_rid_is_validated(rid):
    with start() as s:
        status, _, raw = post(s, "/generate", {"text": "a", "rid": rid})
    assert status == 400 and error_of(raw)["param"] == "rid"


def test_server_chosen_rids_are_unique_and_never_collide_with_client_ones():
    eng = FakeEngine(token_delay=0.005)
    with start(eng) as s:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            res = list(pool.map(lambda i: post(s, "/generate", {
                "text": "q", "sampling_params": {"max_new_tokens": 5}}), range(16)))
        ids = [json.loads(raw)["meta_info"]["id"] for st, _, raw in res if st == 200]
        assert len(ids) == 16 and len(set(ids)) == 16
        assert s.call(lambda: s.app[STATE].rids) == set()


# -- 2. liveness and readiness ------------------------------------------------------------------

class _SlowEngine:
    """An engine (core.frontend.offline.Engine's public methods) whose scheduler is inside a long step:
    stats time out."""

    info = EngineInfo(max_context=64, pool_tokens=64, page_size=1, max_running_requests=4,
                      vocab_size=10, eos_token_ids=(2,), chunked_prefill_size=None,
                      kv_bytes_per_token=64, notes=(), cuda_graph_batch_sizes=(), device="cpu",
                      pid=1)
    tokenizer = SimpleNamespace(special_tokens=())
    plan = spec = None
    args = ServerArgs(model_path="/m/x.gguf")

    def __init__(self, beat_age=0.5):
        self.beat_age = beat_age

    def health(self):
        return True

    def heartbeat_age(self):
        return self.beat_age

    def heartbeat_stats(self):
        return {"running": 3, "waiting": 2, "free_pages": 10, "total_pages": 64,
                "cached_pages": 0, "evictable_pages": 0}

    def stats(self, timeout):
        from core.frontend.offline import EngineError

        time.sleep(timeout)
        raise EngineError(f"engine did not answer 'stats' within {timeout:.0f} s")

    def close(self):
        pass


def _adapter(engine):
    from core.frontend.serving import AsyncEngine

    return AsyncEngine(engine, "x")


def test_liveness_does_not_wait_for_a_scheduler_step():
    a = _adapter(_SlowEngine())
    t0 = time.monotonic()
    assert asyncio.run(a.health()) is True
    assert time.monotonic() - t0 < 0.5  # no round trip through the busy scheduler
    # the figures come from the heartbeat while the step runs: gauges do not vanish
    s = asyncio.run(a.stats())
    assert s["num_running_reqs"] == 3 and s["num_queued_reqs"] == 2 and s["engine"]["stale"]
    a.close()
    stale = _adapter(_SlowEngine(beat_age=60.0))  # no heartbeat for a minute: wedged
    assert asyncio.run(stale.health()) is False
    stale.close()


class _LongStepScheduler:
    """Enough of core.engine.scheduler.Scheduler for core.engine.worker.serve: one step that takes long."""

    def __init__(self, step_s):
        self.step_s, self.todo = step_s, 1
        self.runner = SimpleNamespace(forward_count={}, graph_runner=None)

    @property
    def has_work(self):
        return self.todo > 0

    def poll_timeout(self):
        return 0.0 if self.todo > 0 else 0.5

    def step(self):
        time.sleep(self.step_s)
        self.todo -= 1
        return []

    def stats(self):
        return {"running": self.todo, "waiting": 0}


def test_worker_heartbeats_during_a_long_step():
    from core.engine.worker import EngineCore, serve
    from core.messages import Channel, Heartbeat, Shutdown

    here, there = mp.Pipe(duplex=True)
    core = EngineCore(_LongStepScheduler(step_s=1.5), {}, None)
    th = threading.Thread(target=serve, args=(core, Channel(there), 0.1), daemon=True)
    th.start()
    chan = Channel(here)
    beats, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 1.4:
        if chan.poll(0.05):
            msg = chan.recv()
            if isinstance(msg, Heartbeat):
                beats.append(msg)
    chan.send(Shutdown())
    th.join(10)
    assert not th.is_alive()
    assert len(beats) >= 8, beats  # every 0.1 s while one step runs
    assert max(b.step_s for b in beats) > 1.0
    assert beats[-1].stats["running"] == 1


def test_ready_reflects_load_and_health_does_not():
    eng = FakeEngine(token_delay=0.02)
    with start(eng, max_running_requests=1, max_queued_requests=1) as s:
        assert get(s, "/ready", headers={})[0] == 200
        socks = [send_stream_request(s.port, {"prompt": "l", "max_tokens": 200, "stream": True},
                                     key=KEY) for _ in range(2)]
        for sock in socks:
            read_first_chunk(sock)
        status, hdrs, raw = get(s, "/ready", headers={})
        assert status == 503 and json.loads(raw)["status"] == "busy" and "retry-after" in hdrs
        assert get(s, "/health", headers={})[0] == 200  # busy is alive
        for sock in socks:
            sock.close()
        assert wait_until(lambda: get(s, "/ready", headers={})[0] == 200)
        s.app[STATE].draining = True
        assert json.loads(get(s, "/ready", headers={})[2])["status"] == "draining"


# -- 3 and 13b. API keys -------------------------------------------------------------------------

def test_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="--api-key is empty"):
        make_server_args(api_key="")
    with pytest.raises(ValueError, match="empty"):
        create_app(FakeEngine(), ServerArgs(api_key=""))  # not validated: create_app checks


def test_cli_refuses_an_empty_api_key(capsys):
    from core.cli import main

    assert main(["serve", "--api-key", ""]) == 2
    assert "--api-key is empty" in capsys.readouterr().err


def test_api_key_from_environment_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CORE_API_KEY", "sk-env")
    with start(api_key=None) as s:
        assert get(s, "/v1/models", headers={})[0] == 401
        assert get(s, "/v1/models", headers={"Authorization": "Bearer sk-env"})[0] == 200
        info = json.loads(get(s, "/get_server_info",
                              headers={"Authorization": "Bearer sk-env"})[2])
        assert info["server_args"]["api_key"] == "<redacted>"
    monkeypatch.setenv("CORE_API_KEY", "")
    with pytest.raises(ValueError, match="CORE_API_KEY is empty"):
        create_app(FakeEngine(), ServerArgs())
    monkeypatch.delenv("CORE_API_KEY")
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-file\n")
    with start(api_key=None, api_key_file=str(keyfile)) as s:
        assert get(s, "/v1/models", headers={"Authorization": "Bearer sk-file"})[0] == 200
    keyfile.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        create_app(FakeEngine(), ServerArgs(api_key_file=str(keyfile)))
    with pytest.raises(ValueError, match="No such file"):
        create_app(FakeEngine(), ServerArgs(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="not both"):
        make_server_args(api_key="a", api_key_file=str(keyfile))


def test_401_names_the_bearer_scheme():
    with start() as s:
        status, hdrs, raw = get(s, "/v1/models", headers={})
        assert status == 401 and hdrs["www-authenticate"].startswith("Bearer")
        status, hdrs, _ = get(s, "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and 'error="invalid_token"' in hdrs["www-authenticate"]


# -- 4. a request that can never be admitted ------------------------------------------------------

def test_request_larger_than_capacity_is_400_not_503():
    with start(max_running_requests=1, max_queued_requests=1) as s:
        status, hdrs, raw = post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 3})
        assert status == 400 and "retry-after" not in hdrs
        err = error_of(raw)
        assert err["code"] == "too_many_sequences" and "at most 2" in err["message"]
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 2})[0] == 200


def test_capacity_uses_the_engines_running_limit_when_the_flag_is_unset():
    eng = FakeEngine()
    eng.model_info = lambda: {"model_path": "fake://", "max_running_requests": 2}
    with start(eng, max_queued_requests=1) as s:
        assert s.app[STATE].max_sequences == 3
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 4})[0] == 400


# -- 6. /health_generate -------------------------------------------------------------------------

def test_health_generate_needs_the_key_and_runs_one_probe_at_a_time():
    eng = FakeEngine(token_delay=0.05)
    with start(eng) as s:
        assert get(s, "/health_generate", headers={})[0] == 401
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            res = list(pool.map(lambda _: get(s, "/health_generate"), range(16)))
        assert all(r[0] == 200 for r in res)
        probes = lambda: [r for r in eng.submitted if r.rid.startswith("health-")]  # noqa: E731
        assert len(probes()) == 1  # 16 callers, one engine request
        for _ in range(10):  # within the cache window: no new engine work
            assert get(s, "/health_generate")[0] == 200
        assert len(probes()) == 1
        st = s.app[STATE]
        when, status, body = st.probe_result
        st.probe_result = (when - 10, status, body)  # the answer has aged
        assert get(s, "/health_generate")[0] == 200
        assert len(probes()) == 2
        assert not st.rids and not eng.active


def test_health_generate_reports_a_full_engine_as_busy():
    eng = FakeEngine(token_delay=0.05, max_active=1)
    with start(eng) as s:
        sock = send_stream_request(s.port, {"prompt": "l", "max_tokens": 100, "stream": True},
                                   key=KEY)
        read_first_chunk(sock)
        status, hdrs, raw = get(s, "/health_generate")
        assert status == 503 and json.loads(raw)["status"] == "busy" and "retry-after" in hdrs
        assert get(s, "/health", headers={})[0] == 200
        sock.close()


# -- 7. log injection -----------------------------------------------------------------------------

def test_rids_cannot_forge_log_lines(caplog):
    caplog.set_level("INFO", logger="core.server")
    with start(log_requests=True) as s:
        status, _, _ = post(s, "/generate", {"text": "a", "rid": "x\nINFO core.server: forged",
                                             "sampling_params": {"max_new_tokens": 1}})
        assert status == 400
        assert post(s, "/generate", {"text": "a", "rid": "ok-1", "sampling_params": {
            "max_new_tokens": 1, "stop": ["\nINFO forged"]}})[0] == 200
    assert not any(x.startswith(("INFO forged", "INFO core.server: forged"))
                   for x in caplog.text.splitlines())
    assert any("request 'ok-1' generate" in r.getMessage() for r in caplog.records)
    assert all("\n" not in r.getMessage() for r in caplog.records)


# -- 8 and 9. engine death; drain ---------------------------------------------------------------

def test_engine_death_ends_requests_and_exits_nonzero():
    eng = FakeEngine(token_delay=0.02, context_length=10_000)
    port = free_port()
    args = ServerArgs(port=port)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> tuple[int, float]:
        task = asyncio.create_task(run_server(eng, args))
        for _ in range(500):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.01)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as sess:
            resp = await sess.post(url + "/v1/completions", json={
                "prompt": "a", "max_tokens": 5000, "stream": True})
            await resp.content.readuntil(b"\n\n")
            eng.failed = "engine worker exited (exit code -9)"
            t0 = time.monotonic()
            events = sse_payloads(await resp.read())
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "engine_unavailable"
        rc = await asyncio.wait_for(task, 30)
        return rc, time.monotonic() - t0

    rc, took = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert rc == EXIT_ENGINE_DIED and took < 5 and eng.shut_down and not eng.active


def test_non_loopback_host_without_key_warns(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example")
    port = free_port()

    async def scenario() -> int:
        task = asyncio.create_task(run_server(FakeEngine(), ServerArgs(host="0.0.0.0",
                                                                       port=port)))
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(scenario()) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "0.0.0.0" in err and "without an API key" in err


# -- 12. transport --------------------------------------------------------------------------------

def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock)


@pytest.mark.parametrize("data", [
    b"GARBAGE<script>alert(1)</script>\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header<script>: v\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc<b>\r\n\r\n",
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["garbage", "bad-header-name", "bad-content-length", "long-line"])
def test_malformed_http_is_a_json_error_without_echo_or_traceback(data, caplog):
    caplog.set_level(logging.DEBUG)
    with start() as s:
        raw = _raw(s.port, data)
        text = get(s, "/metrics", headers={})[2].decode()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), raw[:200]
    assert b"application/json" in head and b"Server: core-serve" in head
    err = error_of(body)
    assert err["code"] == "bad_http_request"
    assert b"<script>" not in raw and b"<b>" not in raw and b"aaaa" not in raw
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 'endpoint="malformed_http",outcome="client_error"} 1' in text


def test_slow_headers_are_cut():
    with start(runner_kw={"header_timeout": 0.3}) as s:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
            assert read_all(sock) == b""
        assert time.monotonic() - t0 < 3
        assert get(s, "/health", headers={})[0] == 200  # a whole request is unaffected


def test_slow_body_is_408():
    with start() as s:
        s.app[STATE].body_timeout = 0.3
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")
            t0 = time.monotonic()
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
        assert error_of(head.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"


def test_idle_keep_alive_connections_are_closed():
    assert KEEPALIVE_S == 75.0
    with start(runner_kw={"keepalive": 0.3}) as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert read_all(sock) == b""  # closed by the server, idle
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_post_routes_need_a_json_content_type(ctype):
    with start() as s:
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            hdrs = dict(AUTH)
            if ctype is None:
                hdrs["Content-Type"] = ""
            else:
                hdrs["Content-Type"] = ctype
            status, _, raw = post(s, path, b'{"prompt": "a", "text": "a"}', headers=hdrs)
            assert status == 415 and error_of(raw)["code"] == "unsupported_media_type", path
        hdrs = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
        assert post(s, "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=hdrs)[0] \
            == 200


def test_headers_server_and_allow():
    with start() as s:
        for status_want, (method, path) in ((200, ("GET", "/health")),
                                            (404, ("GET", "/nope")),
                                            (405, ("POST", "/health"))):
            status, hdrs, raw = http_request(s.url, method, path, b"{}" if method == "POST"
                                             else None, AUTH)
            assert status == status_want
            assert hdrs["server"] == "core-serve"  # no Python / aiohttp versions
        status, hdrs, raw = http_request(s.url, "POST", "/health", b"{}", AUTH)
        assert "GET" in hdrs["allow"] and error_of(raw)["code"] == "method_not_allowed"
        status, hdrs, _ = http_request(s.url, "GET", "/v1/completions", None, AUTH)
        assert status == 405 and hdrs["allow"] == "POST"
