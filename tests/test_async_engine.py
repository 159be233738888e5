"""AsyncEngine (core.frontend.serving) over core.frontend.offline.Engine: its deltas, refusals,
aborts and stats, checked against a scripted stand-in with Engine's public methods (no model, no
worker process)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

from core.frontend.delta import Delta
from core.frontend.offline import Engine, EngineError
from core.frontend.refusal import Refused
from core.frontend.serving import AsyncEngine, GenRequest, served_name
from core.messages import EngineInfo, Finish, TokenLogprob
from core.plan.args import ServerArgs

INFO = EngineInfo(max_context=512, pool_tokens=256, page_size=1, max_running_requests=8,
                  vocab_size=100, eos_token_ids=(2,), chunked_prefill_size=None,
                  kv_bytes_per_token=64, notes=(), cuda_graph_batch_sizes=(), device="cpu",
                  pid=1)


def delta(rid, text="", ids=(), finish=None, logprobs=None, cached_tokens=0, error=None):
    return Delta(rid, 0, text, tuple(ids), finish, 3, len(ids), cached_tokens, logprobs,
                 error=error)


class ScriptedClient:
    """Replays a list of deltas per request from another thread, like the reader thread; has
    exactly the public methods of core.frontend.offline.Engine that the adapter may use, and is
    its own `client` (submit and abort, as core.frontend.client.RequestStreams has them)."""

    tokenizer = plan = spec = None
    args = ServerArgs(model_path="/m/x.gguf")

    def __init__(self, script=None, submit_error=None, alive=True, stats=None):
        self.info = INFO
        self.script = script or []
        self.submit_error = submit_error
        self.alive = alive
        self._stats = stats or {}
        self.submitted: list[tuple] = []
        self.aborted: list[str] = []
        self.release = threading.Event()  # deltas after the first wait for this
        self.beat_age = 0.0

    @property
    def client(self):  # requests go to the engine's client (core.frontend.client.RequestStreams)
        return self

    def submit(self, prompt, params, *, input_ids, rid, sink, **kw):
        assert prompt is None  # the server sends token ids
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append((rid, input_ids, params))

        def play():
            for i, d in enumerate(self.script):
                if i == 1:
                    self.release.wait(5)
                sink(dataclasses.replace(d, rid=rid))

        threading.Thread(target=play, daemon=True).start()
        return rid

    def abort(self, rid):
        self.aborted.append(rid)

    def health(self):
        return self.alive

    def heartbeat_age(self):
        return self.beat_age

    def heartbeat_stats(self):
        return None

    def failure(self):
        return None if self.alive else "engine worker exited (exit code None)"

    def stats(self, timeout):
        if not self.alive:
            raise EngineError("engine is not running")
        return self._stats

    def close(self):
        pass


def adapter(engine) -> AsyncEngine:
    return AsyncEngine(engine, "x")


def test_the_adapter_uses_only_the_engines_public_methods():
    """AsyncEngine reads the offline Engine's public methods, and sends requests through the
    engine's client (one worker's EngineClient or a ReplicaSet) with their public methods."""
    import re

    import core.frontend.serving
    from core.frontend.client import EngineClient
    from core.frontend.router import ReplicaSet

    source = Path(core.frontend.serving.__file__).read_text(encoding="utf-8")
    on_client = set(re.findall(r"engine\.client\.(\w+)", source))
    assert on_client == {"submit", "abort"}, on_client
    for cls in (EngineClient, ReplicaSet):
        assert on_client <= {n for n in dir(cls) if not n.startswith("_")}, cls
    public = {n for n in dir(Engine) if not n.startswith("_")}
    assert {"abort", "stats", "health", "heartbeat_age", "heartbeat_stats",
            "failure", "close"} <= public
    on_engine = set(re.findall(r"(?<!core\.)engine\.(\w+)", source)) - {"client"}
    assert on_engine <= public | {"args", "plan", "spec", "info", "tokenizer"}, on_engine - public
    scripted = {n for n in vars(ScriptedClient) if not n.startswith("_")} - {
        "tokenizer", "plan", "spec", "args", "client", "submit"}
    assert scripted <= public, scripted - public  # the stand-in offers nothing Engine lacks


async def collect(a: AsyncEngine, req: GenRequest, limit: int | None = None) -> list[Delta]:
    out = []
    gen = a.generate(req)
    try:
        async for ev in gen:
            out.append(ev)
            if limit is not None and len(out) >= limit:
                break
    finally:
        await gen.aclose()
    return out


REQ = GenRequest(rid="r1", input_ids=(5, 6, 7), sampling={"max_new_tokens": 2},
                 logprobs=True, top_logprobs=1)


def test_the_engines_deltas_reach_the_server_as_they_are():
    script = [delta("r1", "he", [11], logprobs=(TokenLogprob(-0.1, ((11, -0.1),)),)),
              delta("r1", "llo", [12], Finish("stop", matched=2), cached_tokens=2,
                    logprobs=(TokenLogprob(-0.2, ((12, -0.2),)),))]
    client = ScriptedClient(script)
    client.release.set()
    a = adapter(client)
    got = asyncio.run(collect(a, REQ))
    assert got == script  # no re-keying: the typed delta is what the server reads
    rid, ids, params = client.submitted[0]
    assert ids == [5, 6, 7] and params["logprobs"] is True and params["top_logprobs"] == 1
    assert client.aborted == []  # it finished: nothing to abort
    # a consumer that stops at the last delta (as the server's fan-out does) aborts nothing
    again = asyncio.run(collect(a, REQ, limit=len(script)))
    assert again[-1].finished
    a.close()  # flushes the sender thread, where aborts are sent
    assert client.aborted == []


def test_queue_full_rejection_is_503():
    client = ScriptedClient([delta("r1", finish=Finish("abort", status_code=503,
                                                       message="the queue is full"))])
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(client), REQ))
    assert e.value.status == 503 and e.value.retry_after == 1 and e.value.code == "queue_full"
    assert "queue is full" in e.value.message


def test_admission_error_is_400_and_dead_engine_503():
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(ScriptedClient(submit_error=ValueError(
            "prompt of 300 tokens + max_new_tokens 300 = 600 exceeds the context length 512"))),
            REQ))
    assert e.value.status == 400 and "600" in e.value.message
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(ScriptedClient(submit_error=EngineError("gone"))), REQ))
    assert e.value.status == 503 and e.value.code == "engine_unavailable"
    # the worker dies before any output: 503 too; after some output: the same 503 (it was a
    # 500 there: one status for a dead engine, whichever process died, README "Probes")
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(ScriptedClient([Delta.failed("r1", 0, "worker died")])),
                            REQ))
    assert e.value.status == 503
    client = ScriptedClient([delta("r1", "a", [1]), Delta.failed("r1", 0, "worker died")])
    client.release.set()
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(client), REQ))
    assert (e.value.status, e.value.code, e.value.retry_after) == (503, "engine_unavailable", 5)
    assert "worker died" in e.value.message


def test_a_refusal_after_some_output_is_its_status():
    """A constraint that reaches a dead end mid-answer ends with the engine's 400 naming it
    (it was a 200 with finish_reason "abort"), after the tokens it produced."""
    msg = "regex: the constraint can never be satisfied: after 1 tokens its grammar allows no"
    client = ScriptedClient([delta("r1", "a", [1]), delta("r1", finish=Finish(
        "abort", status_code=400, message=msg))])
    client.release.set()
    with pytest.raises(Refused) as e:
        asyncio.run(collect(adapter(client), REQ))
    assert e.value.status == 400 and e.value.message == msg


def test_leaving_early_aborts():
    client = ScriptedClient([delta("r1", "a", [1]), delta("r1", "b", [2], Finish("length"))])
    a = adapter(client)
    events = asyncio.run(collect(a, REQ, limit=1))
    assert len(events) == 1
    a.close()  # flushes the sender thread, where aborts are sent
    assert client.aborted == ["r1"]


def test_stats_and_health():
    stats = {"running": 2, "waiting": 1, "free_pages": 100, "total_pages": 256,
             "cached_pages": 50, "evictable_pages": 40, "cached_tokens": 30,
             "prefill_tokens": 90}
    a = adapter(ScriptedClient(stats=stats))
    s = asyncio.run(a.stats())
    assert s["num_running_reqs"] == 2 and s["num_queued_reqs"] == 1
    assert s["kv_pages_used"] == 256 - 100 - 40 and s["kv_pages_total"] == 256
    assert s["prefix_cache_hit_rate"] == pytest.approx(30 / 120)
    assert asyncio.run(a.health()) is True
    assert asyncio.run(adapter(ScriptedClient(alive=False)).health()) is False
    assert a.context_length == 256  # the KV pool is smaller than the context here


def testserved_name():
    assert served_name(ServerArgs(served_model_name="n"), "/p/m.gguf") == "n"
    assert served_name(ServerArgs(model_path="org/model"), "/p/m.gguf") == "org/model"
    assert served_name(ServerArgs(), "/site/SmolLM2-135M-Instruct.Q4_1.gguf") == \
        "SmolLM2-135M-Instruct"
