"""The process boundary's typed vocabulary (core.messages): every message survives JSON, a malformed
one is a ValueError naming the problem, and the worker is given the plan as data and trusts the
requests the client validated."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import threading
from types import SimpleNamespace

import pytest

from core import messages as ipc
from core.engine.sampling import SamplingParams

INFO = ipc.EngineInfo(max_context=512, pool_tokens=256, page_size=1, max_running_requests=8,
                      vocab_size=100, eos_token_ids=(2,), chunked_prefill_size=None,
                      kv_bytes_per_token=64, notes=("a note",), cuda_graph_batch_sizes=(1, 2),
                      device="cpu", pid=123)
MESSAGES = [
    ipc.AddRequest("r1", (5, 6, 7), SamplingParams(max_new_tokens=4, stop=["x"], seed=-1), 3),
    ipc.AddRequest("r2", (1,), SamplingParams()),
    ipc.Abort("r1"), ipc.Rpc(7, "stats"), ipc.Shutdown(), ipc.Ready(INFO),
    ipc.Fatal("ValueError: boom", "Traceback ..."),
    ipc.StepOutput((
        ipc.OutputItem("r1", (11, 12), (ipc.TokenLogprob(-0.5, ((11, -0.5), (3, -1.5))),
                                        ipc.TokenLogprob(-math.inf, ())),
                       ipc.Finish("stop", matched=2), 3, 2, 1),
        ipc.OutputItem("r2", (), None, ipc.Finish("abort", message="queue full",
                                                  status_code=503), 1, 0, 0),
        ipc.OutputItem("r3", (4,), None, None, 1, 1, 0),
        ipc.OutputItem("r4", (5,), None, None, 3, 1, 0, prompt_logprobs=(
            ipc.TokenLogprob(-2.0, ((9, -0.1),), rank=7), ipc.TokenLogprob(-0.1, (), 1))))),
    ipc.Reply(7, True, {"running": 1}), ipc.Reply(8, False, error="AssertionError: x"),
    ipc.Heartbeat({"running": 2}, 0.25), ipc.Heartbeat(None, 0.0),
    ipc.PrefillBudget(512), ipc.PrefillBudget(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_json(msg):
    data = ipc.encode(msg)
    assert json.loads(data)["type"] == msg.TYPE  # JSON on the wire, nothing pickled
    assert ipc.decode(data) == msg


def test_finish_and_logprobs_keep_their_wire_shape():
    item = MESSAGES[7].items[0]
    assert ipc.to_json(item.finish) == {"type": "stop", "matched": 2}
    d = json.loads(ipc.encode(MESSAGES[7]))["items"][0]
    assert d["logprobs"][0] == [-0.5, [[11, -0.5], [3, -1.5]]]
    assert d["logprobs"][1][0] == -math.inf
    # a rank (prompt logprobs) rides third; without one the pair stays a pair
    ranked = json.loads(ipc.encode(MESSAGES[7]))["items"][3]["prompt_logprobs"]
    assert ranked == [[-2.0, [[9, -0.1]], 7], [-0.1, [], 1]]
    assert ipc.from_json(ipc.TokenLogprob, [-0.5, []]) == ipc.TokenLogprob(-0.5, (), None)
    for bad in ([-0.5], [-0.5, [], 1, 2], [-0.5, [], "1"]):
        with pytest.raises(ValueError, match="malformed logprob"):
            ipc.from_json(ipc.TokenLogprob, bad)


def _raw(params=None, **changes):
    d = ipc.to_json(ipc.AddRequest("r1", (5, 6), SamplingParams()))
    d["params"].update(params or {})
    d.update(changes)
    return json.dumps(d).encode()


@pytest.mark.parametrize("data,match", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "unknown or missing type"),
    (b'{"type": "launch"}', "unknown or missing type 'launch'"),
    (b'{"type": "abort"}', "abort message: missing field.* rid"),
    (b'{"type": "abort", "rid": 5}', "rid must be a string"),
    (b'{"type": "abort", "rid": "r", "x": 1}', "unknown field.* x"),
    (b'{"type": "rpc", "id": 1, "op": "rm -rf"}', "op must be one of stats"),
    (_raw(input_ids=[1, "2"]), "input_ids must be a list of integers"),
    (_raw(input_ids=[1, True]), "input_ids must be a list of integers"),
    (_raw(priority="high"), "priority must be an integer or null"),
    (_raw(params={"temperature": "hot"}), "sampling params: temperature must be a number"),
    (_raw(params={"beam_width": 4}), "sampling params: unknown field.* beam_width"),
    (_raw(params={"stop": "x"}), "sampling params: stop must be a list of strings"),
    (b'{"type": "add", "rid": "r", "input_ids": [], "params": {}, "priority": null}',
     "sampling params: missing field"),
    (b'{"type": "ready", "info": {"pid": 1}}', "engine info: missing field"),
    (b'{"type": "out", "items": [{"rid": "r", "ids": [1], "logprobs": [[0.1]], "finish": '
     b'null, "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}]}',
     "logprob: expected"),
    (b'{"type": "out", "items": [{"rid": "r", "ids": [1, 2], "logprobs": [[0.1, []]], '
     b'"finish": null, "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}]}',
     "1 logprobs for 2 tokens"),
    (b'{"type": "out", "items": [{"rid": "r", "ids": [], "logprobs": null, "finish": '
     b'{"type": "done"}, "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}]}',
     "finish reason: type must be one of stop"),
    (b'{"type": "heartbeat", "stats": [], "step_s": 0}', "stats must be an object or null"),
])
def test_a_malformed_message_is_a_clear_value_error(data, match):
    with pytest.raises(ValueError, match=f"malformed .*{match}"):
        ipc.decode(data)


def test_decoding_checks_shape_only_the_client_validates():
    # A well-formed message whose values the client would refuse decodes as sent: the worker
    # trusts the edge (core.frontend.client.EngineClient.prepare) and does not validate again.
    msg = ipc.decode(_raw(params={"temperature": -1.0}))
    assert isinstance(msg.params, SamplingParams) and msg.params.temperature == -1.0
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1.0})  # what the client does


class _AdmitOnly:
    """A scheduler with only the trusted entry: a worker that re-validated through
    add_request would fail on it."""

    has_work = False
    runner = SimpleNamespace(forward_count={}, graph_runner=None)

    def __init__(self):
        self.admitted = []

    def admit(self, rid, input_ids, params, priority=None, lora=None):
        self.admitted.append((rid, input_ids, params, priority))

    def poll_timeout(self):
        return 0.5

    def stats(self):
        return {}


def test_the_worker_admits_the_typed_request_without_validating_it_again():
    from core.engine.worker import EngineCore, serve

    here, there = mp.Pipe(duplex=True)
    sched = _AdmitOnly()
    th = threading.Thread(target=serve, args=(EngineCore(sched, INFO, None), ipc.Channel(there)),
                          daemon=True)
    th.start()
    chan = ipc.Channel(here)
    params = SamplingParams(max_new_tokens=3, top_k=5)
    chan.send(ipc.AddRequest("r1", (5, 6), params, None))
    chan.send(ipc.Shutdown())
    th.join(10)
    assert not th.is_alive()
    assert sched.admitted == [("r1", [5, 6], params, None)]


def test_the_worker_is_given_the_plan_as_data(monkeypatch):
    from core.engine.worker import args_to_json, make_plan, plan_from_parent, plan_to_json
    from core.plan import devices, resolver
    from core.plan.args import ServerArgs

    args, plan, spec, _ = make_plan(ServerArgs(load_format="dummy"))

    def refuse(*a, **kw):
        raise AssertionError("the worker resolved (or probed) again")

    monkeypatch.setattr(resolver, "resolve", refuse)
    monkeypatch.setattr(devices, "select_device", refuse)
    wargs, wplan, wspec, registry = plan_from_parent(args_to_json(args), plan_to_json(plan))
    assert wplan == plan and wargs == args and wspec.architecture == spec.architecture
    assert registry is not None
    with pytest.raises(ValueError, match="malformed plan"):
        plan_from_parent(args_to_json(args), json.dumps({**plan.to_dict(), "extra_slot": 1}))
