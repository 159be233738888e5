"""SIGTERM draining of run_server (in this process, fake engine): in-flight requests finish,
new connections are refused, what outlives --drain-timeout is aborted, the engine is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import aiohttp
import pytest

from conformance.server_kit import FakeEngine, sse_payloads
from core.plan.args import ServerArgs
from core.server.serve import run_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_listening(port: int, task: asyncio.Task) -> None:
    for _ in range(500):
        assert not task.done(), "run_server exited early"
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.01)
    raise AssertionError("the server never listened")


async def _first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    data = await resp.content.readuntil(b"\n\n")
    assert data.startswith(b"data: ")
    return data


def test_sigterm_lets_inflight_finish_and_refuses_new(capsys):
    eng = FakeEngine(token_delay=0.01)
    port = free_port()
    args = ServerArgs(port=port, drain_timeout=30)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> int:
        task = asyncio.create_task(run_server(eng, args))
        await _wait_listening(port, task)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as sess:
            resp = await sess.post(url + "/v1/completions", json={
                "prompt": "a", "max_tokens": 60, "stream": True})
            first = await _first_chunk(resp)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession(timeout=timeout) as other:
                with pytest.raises(aiohttp.ClientConnectionError):
                    await other.post(url + "/v1/completions", json={"prompt": "b"})
            rest = await resp.read()
            assert rest.endswith(b"data: [DONE]\n\n")
            assert rest.count(b"data: ") + first.count(b"data: ") == 60 + 1
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == 0
    assert eng.finished == 1 and not eng.aborted and eng.shut_down
    out = capsys.readouterr().out
    assert f"listening on http://127.0.0.1:{port}" in out and "draining 1 request" in out


def test_drain_timeout_aborts_what_is_left():
    eng = FakeEngine(token_delay=0.02, context_length=10_000)
    port = free_port()
    args = ServerArgs(port=port, drain_timeout=0.3)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> int:
        task = asyncio.create_task(run_server(eng, args))
        await _wait_listening(port, task)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as sess:
            resp = await sess.post(url + "/v1/completions", json={
                "prompt": "a", "max_tokens": 5000, "stream": True})
            await _first_chunk(resp)
            os.kill(os.getpid(), signal.SIGTERM)
            # cut, but not a bare close: an error event, then [DONE] (issue 16, item 9)
            events = sse_payloads(await resp.read())
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "shutting_down"
            assert "--drain-timeout" in events[-2]["error"]["message"]
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == 0
    assert len(eng.aborted) == 1 and eng.finished == 0 and not eng.active and eng.shut_down


def test_drain_timeout_cuts_a_non_streaming_request_with_503():
    eng = FakeEngine(token_delay=0.02, context_length=10_000)
    port = free_port()
    args = ServerArgs(port=port, drain_timeout=0.3)
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> int:
        task = asyncio.create_task(run_server(eng, args))
        await _wait_listening(port, task)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as sess:
            pending = asyncio.ensure_future(sess.post(url + "/v1/completions", json={
                "prompt": "a", "max_tokens": 5000}))
            while not eng.active:
                await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            resp = await pending
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "shutting_down"
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == 0
    assert len(eng.aborted) == 1 and not eng.active


def test_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        eng = FakeEngine()
        rc = asyncio.run(run_server(eng, ServerArgs(port=port)))
    assert rc == 1 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
