"""Data parallelism (--dp-size): the router's policies exactly, on fake replicas; then one engine
of two replicas over a tiny random Llama, in process and behind the HTTP server: both replicas
serve, greedy outputs equal one engine's, shortest_queue and prefix_aware pick the replica they
should (the prefix cache there says so), abort reaches replica 1, a killed replica is the
engine's failure at once, and close() leaves no process. The test that kills a replica runs
last: it ends the module's engine."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import pytest
from model_fixtures import write_tiny_model

from conformance.server_kit import ServerThread, http_request
from core.frontend import router
from core.frontend.delta import Delta
from core.frontend.router import PrefixAware, PrefixRecord, RoundRobin, ShortestQueue, make_policy
from core.messages import Finish
from core.plan.args import LOAD_BALANCE_METHODS, ServerArgs
from core.server.metrics import ServerMetrics

pytest.importorskip("transformers")

GREEDY = {"max_new_tokens": 8, "temperature": 0}
CONTEXT = 1024  # the tiny model's: room for requests that stay busy for seconds
LONG = {"max_new_tokens": CONTEXT - 16, "temperature": 0, "ignore_eos": True}
POOL = 2048
PROMPTS = [[65 + i, 66, 67, 68 + i] for i in range(4)]


# -- the policies, exactly ------------------------------------------------------------------------

def test_policy_names_are_the_flags_choices():
    for name in LOAD_BALANCE_METHODS:
        assert make_policy(name, 2).name == name
    with pytest.raises(ValueError, match="load-balance-method"):
        make_policy("random", 2)
    assert make_policy("prefix_aware", 2, page_size=64).chunk == 64


def test_round_robin_cycles_over_live_replicas():
    rr = RoundRobin()
    assert [rr.pick([], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.pick([], [0, None, 0]) for _ in range(3)] == [2, 0, 2]  # 1 is dead


def test_shortest_queue_prefers_the_idle_replica():
    sq = ShortestQueue()
    assert sq.pick([], [3, 0, 1]) == 1
    assert sq.pick([], [2, 2, 2]) == 0  # ties: the lowest index
    assert sq.pick([], [None, 5, 4]) == 2


def test_prefix_aware_keeps_a_shared_prefix_on_its_replica():
    pa = PrefixAware(3, chunk=16)
    a = list(range(100, 164))  # 64 tokens, 4 blocks
    assert pa.pick(a, [2, 1, 3]) == 1  # nothing recorded: the least loaded
    b = a[:48] + [7] * 30  # shares 3 blocks with a
    assert pa.matches(b) == [0, 48, 0]
    assert pa.pick(b, [0, 1, 0]) == 1  # the prefix wins over a lower load
    assert pa.pick(a[:15] + [9] * 40, [5, 4, 0]) == 2  # under one block: the least loaded
    assert pa.pick(b, [0, 8, 0]) == 1  # 8 more than the least loaded: still the prefix
    assert pa.pick(b, [0, 9, 0]) == 0  # beyond the threshold: balance
    assert pa.pick(b, [0, None, 1]) == 0  # dead replicas are not picked
    # the longest match wins; ties go to the lower load, then the lower index
    pa = PrefixAware(3, chunk=16)
    pa.records[0].add(pa.blocks(a[:32]))
    pa.records[2].add(pa.blocks(a))
    assert pa.matches(a) == [32, 0, 64] and pa.pick(a, [0, 0, 3]) == 2
    pa.records[0].add(pa.blocks(a))
    assert pa.pick(a, [1, 0, 1]) == 0
    pa.forget()
    assert pa.matches(a) == [0, 0, 0]


def test_prefix_record_evicts_tails_before_heads():
    pa = PrefixAware(1, chunk=16, capacity=4)
    rec = pa.records[0]
    a = list(range(64))
    rec.add(pa.blocks(a))  # 4 blocks: full
    rec.add(pa.blocks([1000 + t for t in range(16)]))  # one more: a's last block goes
    assert rec.match(pa.blocks(a)) == 3 and len(rec.blocks) == 4
    # chained: a block only counts after all the blocks before it
    other = [5] * 16 + a[16:]
    assert rec.match(pa.blocks(other)) == 0
    assert PrefixRecord(2).match([]) == 0


def test_merge_stats_sums_and_keeps_what_does_not_add_up():
    per = [{"running": 2, "waiting": 1, "page_size": 16, "new_token_ratio": 0.5,
            "forward_count": {"decode": 3}, "dp_rank": 0, "alive": True, "routed": 5,
            "in_flight": 3},
           {"running": 1, "waiting": 0, "page_size": 16, "new_token_ratio": 0.7,
            "forward_count": {"decode": 4, "extend": 1}, "dp_rank": 1, "alive": True,
            "routed": 2, "in_flight": 1, "stale": True},
           {"dp_rank": 2, "alive": False, "routed": 1, "in_flight": 0}]
    total = router.merge_stats(per)
    assert total["running"] == 3 and total["waiting"] == 1 and total["routed"] == 8
    assert total["forward_count"] == {"decode": 7, "extend": 1}
    assert total["page_size"] == 16 and "new_token_ratio" not in total
    assert total["stale"] is True and "dp_rank" not in total
    assert (total["alive_replicas"], total["reporting_replicas"]) == (2, 2)
    assert total["replicas"] is per


def test_metrics_label_replicas_by_dp_rank():
    m = ServerMetrics()
    one = m.render({"num_running_reqs": 2, "kv_pages_total": 10}, True)
    assert "core_num_running_reqs 2\n" in one and "dp_rank" not in one
    two = m.render({"num_running_reqs": 3, "replicas": [
        {"dp_rank": 0, "alive": True, "routed": 4, "num_running_reqs": 2},
        {"dp_rank": 1, "alive": False, "routed": 1}]}, False)
    assert 'core_num_running_reqs{dp_rank="0"} 2\n' in two
    assert "core_num_running_reqs 3" not in two  # no total that sum() would count twice
    assert 'dp_rank="1"} ' not in two.split("core_num_running_reqs")[-1]  # no figures: none
    assert 'core_engine_replica_up{dp_rank="1"} 0' in two
    assert 'core_dp_routed_requests_total{dp_rank="0"} 4' in two
    assert "core_engine_up 0" in two


# -- the replica set's bookkeeping, on fake clients ------------------------------------------------

class FakeClient:
    """EngineClient's surface as ReplicaSet uses it; requests stay open until finish()."""

    fail_start: set[int] = set()

    def __init__(self, args, plan, tokenizer, start_timeout=900.0, started=None, replica=0):
        if replica in self.fail_start:
            raise router.EngineError("engine failed to start: no device")
        self.replica, self.closed, self.sinks, self.aborted = replica, False, {}, []
        self.info = SimpleNamespace(pid=1000 + replica)
        self.dead_reason = None
        self.process = SimpleNamespace(is_alive=lambda: not self.closed, exitcode=None)
        self.heartbeat = None

    def health(self):
        return not self.closed and self.dead_reason is None

    def heartbeat_age(self):
        return 0.0

    def rank_failure(self):
        return None

    def prepare(self, prompt, input_ids, params):
        return list(input_ids), params

    def submit_prepared(self, ids, p, *, rid, priority=None, sink, index=0, lora=None):
        self.sinks[rid] = sink
        return rid

    def finish(self, rid, kind="length"):
        self.sinks.pop(rid)(Delta(rid, 0, "", (), Finish(kind)))

    def abort(self, rid):
        self.aborted.append(rid)
        self.finish(rid, "abort")

    def rpc(self, op, timeout=60.0):
        if op == "stats":
            return {"running": len(self.sinks), "waiting": 0, "page_size": 1}
        return True

    def close(self):
        self.closed = True
        for rid in list(self.sinks):
            self.sinks.pop(rid)(Delta.failed(rid, 0, "engine closed"))


@pytest.fixture
def fake_set(monkeypatch):
    monkeypatch.setattr(router, "EngineClient", FakeClient)
    monkeypatch.setattr(FakeClient, "fail_start", set())

    def make(n=2, method="round_robin"):
        args = ServerArgs(dp_size=n, load_balance_method=method)
        return router.ReplicaSet(args, SimpleNamespace(page_size=1, lora_backend=None), None)

    return make


def test_replica_set_routes_counts_and_releases(fake_set):
    rs = fake_set(3, "shortest_queue")
    a = rs.submit(input_ids=[1, 2], params={}, sink=lambda c: None)
    b = rs.submit(input_ids=[1, 2], params={}, sink=lambda c: None)
    assert (rs.owner(a), rs.owner(b), rs.loads()) == (0, 1, [1, 1, 0])
    rs.replicas[0].finish(a)
    assert rs.loads() == [0, 1, 0] and rs.owner(a) is None
    assert rs.submit(input_ids=[3], params={}, sink=lambda c: None) and rs.loads() == [1, 1, 0]
    with pytest.raises(ValueError, match="already in use"):
        rs.submit(input_ids=[3], params={}, rid=b, sink=lambda c: None)
    rs.abort(b)  # reaches the replica that holds it, and only that one
    assert rs.replicas[1].aborted == [b] and not rs.replicas[0].aborted
    rs.abort("unknown")  # no-op
    s = rs.stats()
    assert s["routed"] == 3 and [r["routed"] for r in s["replicas"]] == [2, 1, 0]
    assert s["running"] == 1 and s["alive_replicas"] == 3
    # a dead replica: never picked, and the set's failure names it
    rs.replicas[0].dead_reason = "engine worker exited"
    assert not rs.health()
    assert rs.failure() == "data-parallel replica 0 of 3: engine worker exited"
    picked = {rs.owner(rs.submit(input_ids=[4], params={}, sink=lambda c: None))
              for _ in range(4)}
    assert 0 not in picked
    rs.close()
    assert rs.loads() == [0, 0, 0] and all(c.closed for c in rs.replicas)
    with pytest.raises(router.EngineError, match="not running"):
        rs.submit(input_ids=[4], params={}, sink=lambda c: None)


def test_a_replica_that_fails_to_start_stops_the_others(fake_set, monkeypatch):
    monkeypatch.setattr(FakeClient, "fail_start", {1})
    made = []
    real_init = FakeClient.__init__

    @functools.wraps(real_init)  # keeps its signature: the router passes replica=i
    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(FakeClient, "__init__", init)
    with pytest.raises(router.EngineError, match="replica 1 of 3: engine failed to start"):
        fake_set(3)
    assert len(made) == 2 and all(c.closed for c in made)


# -- two replicas of a tiny Llama -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny-dp") / "llama",
                                max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def reference(tiny_path):
    """One engine's greedy outputs (dp_size 1): what the replicas must give."""
    import core

    with core.Engine(tiny_path, max_total_tokens=POOL) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                          sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def served(tiny_path, reference):
    """(Engine with two replicas, server thread over it)."""
    import core
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    engine = core.Engine(tiny_path, max_total_tokens=POOL, dp_size=2)
    adapter = AsyncEngine(engine, "tiny")
    try:
        with ServerThread(create_app(adapter, engine.args)) as srv:
            yield engine, adapter, srv
    finally:
        adapter.close()


def _get(srv, path):
    status, _, raw = http_request(srv.url, "GET", path, None, {}, timeout=60)
    assert status == 200, raw[:300]
    return raw.decode()


def test_round_robin_serves_on_both_replicas_like_one_engine(served, reference):
    engine, adapter, srv = served
    rs = engine.client
    assert isinstance(rs, router.ReplicaSet) and rs.policy.name == "round_robin"
    pids = [info.pid for info in rs.infos]
    assert len(set(pids)) == 2 and engine.info.pid == pids[0]
    before = list(rs.routed)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert [r - b for r, b in zip(rs.routed, before, strict=True)] == [2, 2]
    # through the HTTP server, one at a time: round robin alternates
    for ids, ref in zip(PROMPTS, reference, strict=True):
        status, _, raw = http_request(srv.url, "POST", "/generate", {
            "input_ids": ids, "sampling_params": GREEDY}, {}, timeout=60)
        assert status == 200 and json.loads(raw)["output_ids"] == ref
    assert [r - b for r, b in zip(rs.routed, before, strict=True)] == [4, 4]
    info = json.loads(_get(srv, "/get_server_info"))
    stats = info["stats"]
    assert [r["dp_rank"] for r in stats["replicas"]] == [0, 1]
    assert all(r["alive"] and r["routed"] >= 4 and r["num_running_reqs"] == 0
               for r in stats["replicas"])
    assert stats["engine"]["finished"] == sum(r["finished"] for r in stats["engine"]["replicas"])
    assert stats["kv_pages_total"] == sum(r["kv_pages_total"] for r in stats["replicas"])
    assert all(r["finished"] >= 4 for r in stats["engine"]["replicas"])
    assert "data parallel      2 replicas, round_robin" in info["plan_table"]
    assert info["model"]["dp_size"] == 2 and info["server_args"]["dp_size"] == 2
    metrics = _get(srv, "/metrics")
    for rank in (0, 1):
        assert f'core_engine_replica_up{{dp_rank="{rank}"}} 1' in metrics
        assert f'core_kv_pages_total{{dp_rank="{rank}"}} {POOL}' in metrics
        routed = next(float(ln.split()[-1]) for ln in metrics.splitlines()
                      if ln.startswith(f'core_dp_routed_requests_total{{dp_rank="{rank}"}}'))
        assert routed >= 4
    assert "core_engine_up 1" in metrics
    engine.check_accounting()


def test_shortest_queue_prefers_the_idle_replica_on_the_engine(served):
    engine, _, _ = served
    rs = engine.client
    rs.policy = ShortestQueue()
    busy = rs.submit(input_ids=[70, 71, 72], params=LONG)  # both idle: replica 0
    assert rs.owner(busy) == 0
    for i in range(3):  # one at a time: replica 0 is busy, 1 idle
        rid = rs.submit(input_ids=[73 + i], params=GREEDY)
        assert rs.owner(rid) == 1 and rs.loads()[0] == 1
        assert list(rs.stream(rid, timeout=60))[-1].finish.type == "length"
    both = [rs.submit(input_ids=[77], params=LONG) for _ in range(2)]
    assert [rs.owner(r) for r in both] == [1, 0]  # 1 while idle; then a tie: the lower index
    for rid in both:
        rs.abort(rid)
        list(rs.stream(rid, timeout=60))
    rs.abort(busy)
    assert list(rs.stream(busy, timeout=60))[-1].finish.type == "abort"
    assert rs.loads() == [0, 0]


def test_prefix_aware_sends_a_shared_prefix_to_the_same_replica(served):
    engine, _, _ = served
    rs = engine.client
    rs.policy = PrefixAware(2, chunk=16)
    busy = rs.submit(input_ids=[80, 81], params=LONG)  # replica 0 (both idle, none matched)
    assert rs.owner(busy) == 0
    system = [40 + (i * 7) % 50 for i in range(64)]  # a long shared prefix
    first = engine.generate(input_ids=system + [1, 2, 3], sampling_params=GREEDY)
    assert rs.policy.matches(system) == [0, 64]  # it went to the idle replica, 1
    rs.abort(busy)
    list(rs.stream(busy, timeout=60))
    assert rs.loads() == [0, 0]
    # both idle again: shortest_queue would take 0; the prefix is on 1
    rid = rs.submit(input_ids=system + [4, 5], params=GREEDY)
    assert rs.owner(rid) == 1
    last = list(rs.stream(rid, timeout=60))[-1]
    assert last.cached_tokens >= len(system)  # replica 1's prefix cache
    assert first["meta_info"]["cached_tokens"] < len(system)
    rs.policy = RoundRobin()


def test_abort_reaches_replica_1(served):
    engine, adapter, _ = served
    rs = engine.client
    rs.policy = ShortestQueue()
    hold = rs.submit(input_ids=[90], params=LONG)  # replica 0
    chunks = []
    rid = rs.submit(input_ids=[91, 92], params=LONG, sink=chunks.append, rid="dp-abort-1")
    assert rs.owner(rid) == 1 and rs.owner(hold) == 0
    deadline = time.monotonic() + 30
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    adapter.abort(rid)  # the server's path: its sender thread, then the router
    deadline = time.monotonic() + 30
    while not (chunks and chunks[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert chunks[-1].finish.type == "abort"
    assert sum(len(c.token_ids) for c in chunks) < LONG["max_new_tokens"]
    assert rs.owner(hold) == 0 and rs.loads() == [1, 0]  # replica 0's request runs on
    try:
        # a replica inside a step answers with its last heartbeat's figures, which on a busy
        # machine may predate hold's admission: ask until they show it (or 30 s pass)
        deadline = time.monotonic() + 30
        while True:
            per = engine.stats()["replicas"]
            if per[0].get("running") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert per[1]["aborted"] >= 1 and per[1]["running"] == 0
        assert per[0]["running"] == 1, per[0]
    finally:  # the next tests expect both replicas idle
        rs.abort(hold)
        list(rs.stream(hold, timeout=60))
        rs.policy = RoundRobin()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_replica_is_the_engines_failure_and_close_leaves_nothing(served):
    """Last: it ends the module's engine."""
    from core.server.serve import _failure

    engine, adapter, srv = served
    rs = engine.client
    rs.policy = ShortestQueue()
    hold = rs.submit(input_ids=[95], params=LONG)  # replica 0
    doomed = rs.submit(input_ids=[96], params=LONG)  # replica 1
    assert (rs.owner(hold), rs.owner(doomed)) == (0, 1)
    pids = [info.pid for info in rs.infos]
    procs = [c.process for c in rs.replicas]
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(router.EngineError, match="exited|failed"):
        for _ in rs.stream(doomed, timeout=30):
            pass
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 30
    while engine.failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    reason = _failure(adapter)  # what the server's watchdog reads: it then exits
    assert reason is not None and reason.startswith("data-parallel replica 1 of 2: ")
    assert not engine.health()
    status, _, _ = http_request(srv.url, "GET", "/health", None, {}, timeout=30)
    assert status == 503
    metrics = _get(srv, "/metrics")
    assert 'core_engine_replica_up{dp_rank="1"} 0' in metrics and "core_engine_up 0" in metrics
    # until the server exits, new requests go to the live replica only, and are served
    rid = rs.submit(input_ids=[97], params=GREEDY)
    assert rs.owner(rid) == 0
    assert list(rs.stream(rid, timeout=60))[-1].finish.type == "length"
    assert rs.owner(hold) == 0
    adapter.close()
    assert not any(_alive(pid) for pid in pids)
    assert not any(p in mp.active_children() for p in procs)
    assert not any(c.process.is_alive() for c in rs.replicas)


def test_core_serve_dp2_answers_labels_its_replicas_and_sigterm_leaves_nothing(tiny_path):
    """The command line itself: `core serve --dp-size 2` on the CPU."""
    import urllib.request

    from test_tp import start_serve

    from core.engine.distributed import free_loopback_port

    port = free_loopback_port()
    proc, children = start_serve(tiny_path, port, "--dp-size", "2", "--max-total-tokens",
                                 str(POOL), "--load-balance-method", "round_robin")
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(2):  # round robin: one request on each replica
            body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
                assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        for rank in ("0", "1"):
            assert f'core_dp_routed_requests_total{{dp_rank="{rank}"}} 1' in metrics, metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(int(p)) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in children)
