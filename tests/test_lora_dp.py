"""LoRA adapters loaded and unloaded at run time under data parallelism (--dp-size 2): every
replica ends up holding the same adapters whatever one of them refuses, a request naming an
adapter is routed only while every replica holds it, and the server lists and refuses as with
one engine. First on fake replicas (core.frontend.router.ReplicaSet's bookkeeping, each
partial failure made exactly), then on two replicas of a tiny random Llama behind the HTTP
server, against HF transformers + PEFT."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

# peft imports triton: a Triton test module collected after this one finds it imported already,
# so the interpreter is chosen here, as tests/test_lora.py does
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.server_kit import ServerThread, http_request  # noqa: E402
from core.frontend import router  # noqa: E402
from core.frontend.delta import Delta  # noqa: E402
from core.messages import Finish  # noqa: E402
from core.plan.args import ServerArgs  # noqa: E402

# -- the router's bookkeeping, on fake replicas ---------------------------------------------------


class FakeReplica:
    """EngineClient's surface as ReplicaSet uses it, with a worker's LoRA record: loads,
    unloads and their refusals as the worker gives them; `refuse[op]` makes it refuse that op
    with the text given; `gate[op]` holds that op until the event is set."""

    def __init__(self, args, plan, tokenizer, start_timeout=900.0, started=None, replica=0):
        self.replica, self.closed, self.sinks = replica, False, {}
        self.info = SimpleNamespace(pid=1000 + replica)
        self.dead_reason = None
        self.process = SimpleNamespace(is_alive=lambda: not self.closed, exitcode=None)
        self.heartbeat = None
        self.adapters = {s.split("=")[0]: s.split("=")[1] for s in args.lora_paths or ()}
        self.calls: list[tuple] = []
        self.refuse: dict[str, str] = {}
        self.gate: dict[str, threading.Event] = {}
        self.submitted: list[tuple[str, str | None]] = []

    def health(self):
        return not self.closed

    def heartbeat_age(self):
        return 0.0

    def rank_failure(self):
        return None

    def prepare(self, prompt, input_ids, params):
        return list(input_ids), params

    def submit_prepared(self, ids, p, *, rid, priority=None, sink, index=0, lora=None):
        assert lora is None or lora in self.adapters, "routed to a replica without it"
        self.sinks[rid] = sink
        self.submitted.append((rid, lora))
        return rid

    def finish(self, rid):
        self.sinks.pop(rid)(Delta(rid, 0, "", (), Finish("length")))

    def abort(self, rid):
        self.finish(rid)

    def update_lora(self, op, name, path=None, timeout=120.0):
        self.calls.append((op, name, path))
        if op in self.gate:
            assert self.gate[op].wait(10)
        if op in self.refuse:
            raise ValueError(self.refuse[op])
        if op == "load_lora":
            if name in self.adapters:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            self.adapters[name] = path
            return {"name": name, "rank": 8, "replica": self.replica}
        if name not in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name]
        return {"name": name}

    def rpc(self, op, timeout=60.0):
        return {"running": len(self.sinks), "waiting": 0} if op == "stats" else True

    def close(self):
        self.closed = True


@pytest.fixture
def replicas(monkeypatch):
    """A ReplicaSet of two fake replicas with LoRA on and adapter s named at start."""
    monkeypatch.setattr(router, "EngineClient", FakeReplica)
    args = ServerArgs(dp_size=2, lora_paths=("s=/adapters/s",))
    rs = router.ReplicaSet(args, SimpleNamespace(page_size=1, lora_backend="torch_native"),
                           None)
    yield rs
    for r in rs.replicas:  # a test that failed midway leaves no update waiting
        for gate in r.gate.values():
            gate.set()
    rs.close()


def _refusing(real, op, exc):
    """`real` (an update_lora) that raises `exc` for `op`, as a replica refusing it."""
    def update_lora(o, name, *a, **k):
        if o == op:
            raise exc
        return real(o, name, *a, **k)
    return update_lora


def _send(rs, lora, n=1):
    """Submit n requests naming `lora`; their deltas (a refused one's at once) by rid."""
    got: dict[str, list[Delta]] = {}
    for _ in range(n):
        box: list[Delta] = []
        got[rs.submit(input_ids=[1, 2], params={}, lora=lora, sink=box.append)] = box
    return got


def _refused(deltas):
    return all(len(d) == 1 and d[0].finish.status_code == 404
               and "is not loaded" in d[0].finish.message for d in deltas.values())


def test_a_load_reaches_every_replica_before_requests_may_name_it(replicas):
    rs = replicas
    assert rs.lora_adapters() == {"s": "/adapters/s"}
    one = rs.replicas[1]
    one.gate["load_lora"] = threading.Event()
    t = threading.Thread(target=rs.update_lora, args=("load_lora", "x", "/adapters/x"))
    t.start()
    while not one.calls:  # replica 1 is loading it (replica 0 may have it already)
        time.sleep(0.01)
    assert "x" not in rs.lora_adapters()
    assert _refused(_send(rs, "x", 4)) and rs.routed == [0, 0]
    one.gate["load_lora"].set()
    t.join(10)
    assert rs.lora_adapters() == {"s": "/adapters/s", "x": "/adapters/x"}
    sent = _send(rs, "x", 4)
    assert not any(sent.values()) and rs.routed == [2, 2]  # both replicas serve it
    assert all(("x" in r.adapters) for r in rs.replicas)


def test_a_load_one_replica_refuses_leaves_it_on_none(replicas):
    rs = replicas
    rs.replicas[1].refuse["load_lora"] = "/adapters/big: rank 32 is over --max-lora-rank 16"
    with pytest.raises(ValueError, match="^data-parallel replica 1: /adapters/big: rank 32"):
        rs.update_lora("load_lora", "big", "/adapters/big")
    assert rs.replicas[0].calls == [("load_lora", "big", "/adapters/big"),
                                    ("unload_lora", "big", None)]
    assert all("big" not in r.adapters for r in rs.replicas)
    assert rs.lora_adapters() == {"s": "/adapters/s"} and _refused(_send(rs, "big"))
    # the set keeps serving, and the name can be loaded once the replica takes it
    del rs.replicas[1].refuse["load_lora"]
    assert rs.update_lora("load_lora", "big", "/adapters/big")["replica"] == 0
    assert "big" in rs.lora_adapters()
    # a name taken, or unknown, is refused by the router in the worker's words, asking none
    calls = [list(r.calls) for r in rs.replicas]
    with pytest.raises(ValueError, match="^LoRA adapter 'big' is already loaded"):
        rs.update_lora("load_lora", "big", "/adapters/other")
    with pytest.raises(ValueError, match="^LoRA adapter 'nope' is not loaded"):
        rs.update_lora("unload_lora", "nope")
    assert [r.calls for r in rs.replicas] == calls
    # a refusal every replica gives (a bad folder) names replica 0, and changes nothing
    for r in rs.replicas:
        r.refuse["load_lora"] = "/adapters/none: no such directory"
    with pytest.raises(ValueError, match="^data-parallel replica 0: /adapters/none: no such"):
        rs.update_lora("load_lora", "d", "/adapters/none")
    assert set(rs.lora_adapters()) == {"s", "big"}


def test_an_unload_one_replica_refuses_loads_it_again_where_it_went(replicas):
    rs = replicas
    rs.update_lora("load_lora", "x", "/adapters/x")
    for name, path in (("x", "/adapters/x"), ("s", "/adapters/s")):  # run time, and at start
        rs.replicas[1].refuse["unload_lora"] = (f"LoRA adapter {name!r} is in use by 1 "
                                                "request(s); unload it once they finish")
        with pytest.raises(ValueError, match=f"^data-parallel replica 1: .*{name}.*in use"):
            rs.update_lora("unload_lora", name)
        assert rs.replicas[0].calls[-2:] == [("unload_lora", name, None),
                                             ("load_lora", name, path)]
        assert all(r.adapters.get(name) == path for r in rs.replicas)
        assert rs.lora_adapters()[name] == path
        del rs.replicas[1].refuse["unload_lora"]
    assert not any(_send(rs, "x", 2).values())  # still served, on both
    # a replica that dies mid-unload: the engine's error, naming it
    rs.replicas[0].refuse.clear()
    rs.replicas[1].update_lora = _refusing(rs.replicas[1].update_lora, "unload_lora",
                                           router.EngineError("engine is not running: engine "
                                                              "worker exited"))
    with pytest.raises(router.EngineError, match="^data-parallel replica 1: engine is not"):
        rs.update_lora("unload_lora", "s")


def test_an_adapter_being_unloaded_takes_no_new_request(replicas):
    rs = replicas
    busy = _send(rs, "s")  # open: the router counts it until its last delta
    with pytest.raises(ValueError, match="'s' is in use by 1 request"):
        rs.update_lora("unload_lora", "s")
    assert not any(r.calls for r in rs.replicas)  # refused before any replica was asked
    rs.replicas[0].finish(next(iter(busy)))
    one = rs.replicas[1]
    one.gate["unload_lora"] = threading.Event()
    t = threading.Thread(target=rs.update_lora, args=("unload_lora", "s"))
    t.start()
    while not one.calls:
        time.sleep(0.01)
    assert rs.lora_adapters() == {}  # hidden before the unloads
    assert _refused(_send(rs, "s", 2))
    # updates run one at a time: a load waits for the unload in flight
    other = threading.Thread(target=rs.update_lora, args=("load_lora", "y", "/adapters/y"))
    other.start()
    other.join(0.2)
    assert other.is_alive() and all(("load_lora", "y", "/adapters/y") not in r.calls
                                    for r in rs.replicas)
    one.gate["unload_lora"].set()
    t.join(10)
    other.join(10)
    assert rs.lora_adapters() == {"y": "/adapters/y"}
    assert all(set(r.adapters) == {"y"} for r in rs.replicas)


def test_lora_off_refuses_updates_and_leaves_requests_to_the_worker(monkeypatch):
    monkeypatch.setattr(router, "EngineClient", FakeReplica)
    rs = router.ReplicaSet(ServerArgs(dp_size=2),
                           SimpleNamespace(page_size=1, lora_backend=None), None)
    try:
        assert rs.lora_adapters() is None
        with pytest.raises(ValueError, match="LoRA is off"):
            rs.update_lora("load_lora", "x", "/x")
    finally:
        rs.close()


# -- two replicas of a tiny Llama, behind the HTTP server -----------------------------------------

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 10, 20, 30, 40, 50, 60, 70, 80, 90],
           [256, 5, 4, 3], [256, 200, 201, 202, 203, 7]]
N_NEW = 6
SP = {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(Engine of two replicas with LoRA on and no adapter, server thread, adapter folder)."""
    pytest.importorskip("peft")
    from model_fixtures import write_peft_adapter, write_tiny_model

    import core
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    root = tmp_path_factory.mktemp("lora-dp")
    model = write_tiny_model("llama", root / "model")
    adapter = write_peft_adapter("llama", root / "c", r=8, alpha=16, seed=5,
                                 target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    engine = core.Engine(str(model), dtype="float32", max_total_tokens=512, page_size=4,
                         dp_size=2, enable_lora=True)
    wrapped = AsyncEngine(engine, "tiny")
    try:
        with ServerThread(create_app(wrapped, engine.args)) as srv:
            yield engine, srv, adapter
    finally:
        wrapped.close()


def _post(srv, path, body):
    status, _, raw = http_request(srv.url, "POST", path, body, timeout=120)
    return status, json.loads(raw)


def _adapters_per_replica(engine):
    return [r["lora_adapters"] for r in engine.stats()["replicas"]]


def _completion(srv, model, prompt):
    return _post(srv, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": N_NEW,
                                          "temperature": 0, "ignore_eos": True,
                                          "return_token_ids": True})


def test_load_serve_on_both_replicas_and_unload(served):
    from model_fixtures import greedy_reference, peft_reference

    engine, srv, adapter = served
    rs = engine.client
    want = [greedy_reference(peft_reference("llama", adapter), p, N_NEW)[0] for p in PROMPTS]
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "c",
                                                     "lora_path": str(adapter)})
    assert status == 200 and body["loaded_adapters"] == ["c"], body
    assert _adapters_per_replica(engine) == [1, 1]
    status, _, raw = http_request(srv.url, "GET", "/v1/models")
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    assert status == 200 and set(cards) == {"tiny", "c"}
    assert cards["c"]["parent"] == "tiny" and cards["c"]["root"] == str(adapter)
    # requests naming it land on both replicas (round robin) and match HF + PEFT
    before = list(rs.routed)
    outs = engine.generate(input_ids=PROMPTS, lora_path="c", sampling_params=SP)
    assert [o["output_ids"] for o in outs] == want
    for prompt, ref in zip(PROMPTS[:2], want, strict=False):
        status, body = _completion(srv, "c", prompt)
        assert status == 200 and body["choices"][0]["token_ids"] == ref, body
    assert [r - b for r, b in zip(rs.routed, before, strict=True)] == [3, 3]
    # unloaded: requests naming it are refused, by the server and by the router alike
    status, body = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 200 and body["loaded_adapters"] == []
    assert _adapters_per_replica(engine) == [0, 0]
    status, body = _completion(srv, "c", PROMPTS[0])
    assert status == 404 and body["error"]["code"] == "model_not_found"
    out = engine.generate(input_ids=PROMPTS[0], lora_path="c", sampling_params=SP)
    assert out["meta_info"]["finish_reason"]["status_code"] == 404
    status, body = _post(srv, "/unload_lora_adapter", {"lora_name": "c"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_failed_load_leaves_no_replica_with_it_and_the_engine_serves(served, tmp_path):
    from model_fixtures import write_peft_adapter

    engine, srv, adapter = served
    big = write_peft_adapter("llama", tmp_path / "big", r=32, alpha=8, seed=8)
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "big",
                                                     "lora_path": str(big)})
    assert status == 400 and "rank 32 is over --max-lora-rank 16" in body["error"]["message"]
    with pytest.raises(ValueError, match="data-parallel replica 0: .*no such directory"):
        engine.load_lora_adapter("d", str(tmp_path / "none"))
    # replica 1 refuses one that replica 0 took: replica 0 drops it again
    one = engine.client.replicas[1]
    one.update_lora = _refusing(one.update_lora, "load_lora", ValueError("disk full"))
    try:
        with pytest.raises(ValueError, match="^data-parallel replica 1: disk full"):
            engine.load_lora_adapter("c", str(adapter))
    finally:
        del one.update_lora
    assert _adapters_per_replica(engine) == [0, 0] and engine.lora_adapters() == {}
    out = engine.generate(input_ids=[PROMPTS[1]] * 2, sampling_params=SP)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in out)


def test_an_unload_one_replica_refuses_leaves_it_on_both(served):
    engine, srv, adapter = served
    engine.load_lora_adapter("c", str(adapter))
    want = engine.generate(input_ids=PROMPTS[2], lora_path="c", sampling_params=SP)
    one = engine.client.replicas[1]
    one.update_lora = _refusing(one.update_lora, "unload_lora", ValueError(
        "LoRA adapter 'c' is in use by 1 request(s); unload it once they finish"))
    try:
        status, body = _post(srv, "/unload_lora_adapter", {"lora_name": "c"})
    finally:
        del one.update_lora
    assert status == 400 and "replica 1: LoRA adapter 'c' is in use" in body["error"]["message"]
    # replica 0 unloaded it and loaded it again from its folder: both hold it, both serve it
    assert _adapters_per_replica(engine) == [1, 1] and engine.lora_adapters() == {
        "c": str(adapter)}
    outs = engine.generate(input_ids=[PROMPTS[2]] * 2, lora_path="c", sampling_params=SP)
    assert [o["output_ids"] for o in outs] == [want["output_ids"]] * 2
    # a request the router sent still runs: the unload is refused before any replica changes
    rid = engine.client.submit(input_ids=PROMPTS[0], params={
        "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}, lora="c")
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.unload_lora_adapter("c")
    engine.client.abort(rid)
    for _ in engine.client.stream(rid, timeout=60):
        pass
    engine.unload_lora_adapter("c")
    assert _adapters_per_replica(engine) == [0, 0]
