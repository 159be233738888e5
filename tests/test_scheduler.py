"""The scheduler in-process on a tiny random Llama: batching must never change greedy outputs.

Every scenario runs the same requests and compares with each request run alone; the KV page
accounting is checked after each one.
"""

from __future__ import annotations

import json
import time

import pytest
from model_fixtures import write_tiny_model

from core.engine.loader import load_model
from core.engine.scheduler import AdmissionError
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args

MAX_NEW = 24
PROMPT_LENS = (3, 40, 9, 17, 1, 33, 5, 26)


def _prompts():
    # deterministic token ids in the byte range, different lengths, two sharing a prefix
    out = [[(7 * i + 13 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    out[5] = out[1][:20] + out[5][20:]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama"))
    args, plan, _, registry = make_plan(make_server_args(model_path=path, dtype="float32"))
    return path, load_model(args, plan, registry)


def make_core(tiny, **kw):
    path, loaded = tiny
    kw.setdefault("max_total_tokens", 2048)
    args = make_server_args(model_path=path, dtype="float32", **kw)
    args, plan, spec, registry = make_plan(args)
    return build_engine_core(args, plan, spec, registry, loaded)


def drive(sched, requests, stagger: int = 0):
    """Add requests (all at once, or one every `stagger` steps) and step until all finish."""
    pending = list(requests)
    results, step = {}, 0
    deadline = time.monotonic() + 300
    while pending or sched.has_work:
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for rid, ids, params in batch:
                sched.add_request(rid, ids, params)
            pending = pending[len(batch):]
        out = sched.step()
        for req in out:
            if req.finish is not None:
                results[req.rid] = (list(req.output_ids), req.finish)
        if not out and sched.compiling:  # waiting for a grammar compile (its own thread)
            assert time.monotonic() < deadline, "a grammar compile never finished"
            time.sleep(sched.poll_timeout())
            continue
        step += 1
        assert step < 10_000, "the scheduler made no progress"
    return results


def greedy(max_new=MAX_NEW, **kw):
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, **kw}


def _requests(prompts=None, **kw):
    return [(f"r{i}", p, greedy(**kw)) for i, p in enumerate(prompts or _prompts())]


@pytest.fixture(scope="module")
def alone(tiny):
    core = make_core(tiny)
    out = {}
    for rid, ids, params in _requests():
        out.update(drive(core.scheduler, [(rid, ids, params)]))
        core.scheduler.check_accounting()
    assert all(len(ids) == MAX_NEW for ids, _ in out.values())
    return out


SCENARIOS = {
    "default": {},
    "no-radix": {"disable_radix_cache": True},
    "chunk16": {"chunked_prefill_size": 16},
    "page16": {"page_size": 16},
    "page16-chunk16-no-radix": {"page_size": 16, "chunked_prefill_size": 16,
                                "disable_radix_cache": True},
    "small-prefill-budget": {"max_prefill_tokens": 20, "chunked_prefill_size": -1},
    "max-running-2": {"max_running_requests": 2},
    "lpm": {"schedule_policy": "lpm"},
    "lof": {"schedule_policy": "lof"},
    "random": {"schedule_policy": "random"},
    "lfu": {"radix_eviction_policy": "lfu", "page_size": 4},
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_together_equals_alone(tiny, alone, name):
    core = make_core(tiny, **SCENARIOS[name])
    sched = core.scheduler
    for stagger in (0, 3):
        got = drive(sched, [(f"{rid}-{stagger}", ids, p) for rid, ids, p in _requests()],
                    stagger)
        sched.check_accounting()
        for rid, (ids, _) in alone.items():
            assert got[f"{rid}-{stagger}"][0] == ids, f"{rid} differs ({name}, stagger {stagger})"
            assert got[f"{rid}-{stagger}"][1] == {"type": "length", "length": MAX_NEW}


@pytest.mark.parametrize("page_size,pool", [(1, 100), (16, 128)])
def test_retraction_keeps_outputs_exact(tiny, alone, page_size, pool):
    core = make_core(tiny, page_size=page_size, max_total_tokens=pool,
                     schedule_conservativeness=0.05)
    sched = core.scheduler
    for radix in (True, False):
        if not radix:
            core = make_core(tiny, page_size=page_size, max_total_tokens=pool,
                             schedule_conservativeness=0.05, disable_radix_cache=True)
            sched = core.scheduler
        got = drive(sched, _requests())
        sched.check_accounting()
        assert sched.counters["retractions"] > 0, "the pool was meant to force retraction"
        assert {rid: ids for rid, (ids, _) in got.items()} == \
            {rid: ids for rid, (ids, _) in alone.items()}


def test_chunked_prefill_uses_several_forwards(tiny, alone):
    core = make_core(tiny, chunked_prefill_size=16)
    got = drive(core.scheduler, [("long", _prompts()[1], greedy())])  # 40 tokens: 3 chunks
    assert got["long"][0] == alone["r1"][0]
    assert core.scheduler.runner.forward_count["extend"] == 3


def test_prefix_cache_hits_are_reported_and_shared(tiny, alone):
    core = make_core(tiny, page_size=4)
    sched = core.scheduler
    p = _prompts()
    drive(sched, [("first", p[1], greedy())])
    sched.add_request("second", p[5], greedy())
    req = sched.by_id["second"]
    got = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish:
                got[r.rid] = r.output_ids
    assert req.cached_tokens == 20  # the shared 20-token prefix, whole pages of 4
    assert got["second"] == alone["r5"][0]
    assert sched.counters["cached_tokens"] >= 20
    sched.check_accounting()
    assert sched.cache.cached_tokens > 0


def test_requests_that_never_fit_are_rejected_with_numbers(tiny):
    sched = make_core(tiny, max_total_tokens=64).scheduler
    with pytest.raises(AdmissionError, match=r"needs 80 KV tokens; the KV pool holds 64"):
        sched.add_request("big", list(range(3, 53)), greedy(max_new=30))
    with pytest.raises(AdmissionError, match=r"= 300 exceeds the context length 256"):
        sched.add_request("long", list(range(3, 203)), greedy(max_new=100))
    with pytest.raises(AdmissionError, match="empty"):
        sched.add_request("empty", [], greedy())
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        sched.add_request("oov", [1, 999], greedy())
    with pytest.raises(ValueError, match="temperature"):
        sched.add_request("bad", [1, 2], {"temperature": -1})
    assert sched.counters["rejected"] == 5 and not sched.has_work


def test_queue_limit_rejects_clearly(tiny):
    # a burst of max_running + max_queued is accepted whole: the first max_running of it are
    # about to run (free slots), not queued (issue 16, item 5)
    sched = make_core(tiny, max_running_requests=1, max_queued_requests=2).scheduler
    sched.add_request("a", [5, 6], greedy())
    sched.add_request("b", [5, 7], greedy())
    sched.add_request("c", [5, 9], greedy())
    with pytest.raises(AdmissionError, match=r"queue is full.*max-queued-requests 2") as err:
        sched.add_request("d", [5, 8], greedy())
    assert err.value.status == 503
    drive(sched, [])
    sched.check_accounting()


def test_priority_scheduling(tiny):
    sched = make_core(tiny, enable_priority_scheduling=True, max_running_requests=1).scheduler
    sched.add_request("low", [5, 6, 7], greedy(max_new=2), priority=0)
    sched.add_request("high", [5, 6, 8], greedy(max_new=2), priority=10)
    order = []
    while sched.has_work:
        order += [r.rid for r in sched.step() if r.finish]
    assert order == ["high", "low"]
    off = make_core(tiny).scheduler
    with pytest.raises(AdmissionError, match="enable-priority-scheduling"):
        off.add_request("p", [5, 6], greedy(), priority=3)


def test_priority_preempts_running_requests(tiny, alone):
    """A high-priority arrival that finds the running batch full retracts the lowest-priority
    running request (at least the threshold below it); outputs stay those of a lone run."""
    prompts = _prompts()
    params = greedy(max_new=MAX_NEW)
    sched = make_core(tiny, enable_priority_scheduling=True, max_running_requests=2).scheduler
    sched.add_request("low", prompts[1], params, priority=0)
    sched.add_request("mid", prompts[3], params, priority=5)
    results = {}
    for _ in range(4):
        for r in sched.step():
            assert r.finish is None
    assert {r.rid for r in sched.running} == {"low", "mid"}
    sched.add_request("high", prompts[2], params, priority=15)
    sched.step()
    # only "low" is 10 below "high": it makes room, "mid" keeps running
    assert {r.rid for r in sched.running} == {"mid", "high"}
    assert sched.counters["preemptions"] == 1 and sched.counters["retractions"] == 0
    while sched.has_work:
        for r in sched.step():
            if r.finish is not None:
                results[r.rid] = list(r.output_ids)
    assert results == {"low": alone["r1"][0], "mid": alone["r3"][0], "high": alone["r2"][0]}
    sched.check_accounting()


def test_priority_below_threshold_waits(tiny):
    sched = make_core(tiny, enable_priority_scheduling=True, max_running_requests=1,
                      priority_scheduling_preemption_threshold=10).scheduler
    sched.add_request("low", _prompts()[1], greedy(max_new=8), priority=0)
    sched.step()
    sched.add_request("higher", _prompts()[2], greedy(max_new=8), priority=9)
    order = []
    while sched.has_work:
        order += [r.rid for r in sched.step() if r.finish]
    assert order == ["low", "higher"]
    assert sched.counters["preemptions"] == 0
    sched.check_accounting()


def test_abort_frees_everything(tiny):
    sched = make_core(tiny).scheduler
    sched.add_request("a", _prompts()[1], greedy(max_new=50))
    sched.add_request("b", _prompts()[2], greedy(max_new=50))
    sched.add_request("c", _prompts()[3], greedy(max_new=50))
    for _ in range(3):
        sched.step()
    assert sched.abort("a") and sched.abort("b")
    assert not sched.abort("a")  # already gone
    done = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish:
                done[r.rid] = r.finish["type"]
    assert done == {"a": "abort", "b": "abort", "c": "length"}
    sched.check_accounting()


def test_stop_conditions(tiny, alone):
    sched = make_core(tiny).scheduler
    ref = alone["r2"][0]
    p = _prompts()[2]
    # stop token id: stops at its first occurrence (the token is kept in the output)
    tok = ref[5]
    got = drive(sched, [("s", p, greedy(stop_token_ids=[tok]))])["s"]
    assert got[0] == ref[:ref.index(tok) + 1] and got[1] == {"type": "stop", "matched": tok}
    # min_new_tokens masks the stop token until enough tokens were produced
    got = drive(sched, [("m", p, greedy(stop_token_ids=[ref[0]], min_new_tokens=3))])["m"]
    assert ref[0] not in got[0][:3]
    # eos is honoured unless ignore_eos
    eos = next(iter(sched.eos))
    sched.eos = {ref[4]}
    got = drive(sched, [("e", p, {"max_new_tokens": MAX_NEW, "temperature": 0})])["e"]
    assert got[0] == ref[:ref.index(ref[4]) + 1]
    sched.eos = {eos}
    sched.check_accounting()


def test_stop_strings_on_detokenized_text(tiny, alone):
    core = make_core(tiny)
    sched = core.scheduler
    tok = core.loaded.tokenizer
    # The byte-level fixture tokenizer: find two printable ASCII bytes in a row in some output.
    found = [(int(rid[1:]), ids, i) for rid, (ids, _) in sorted(alone.items())
             for i in range(1, len(ids) - 1) if all(32 <= t < 127 for t in ids[i:i + 2])]
    assert found, "no printable pair in any output (fixture changed?)"
    k, ids, i = found[0]
    stop = tok.decode(ids[i:i + 2])
    prompt = _prompts()[k]
    got = drive(sched, [("x", prompt, greedy(stop=[stop]))])["x"]
    assert got[1] == {"type": "stop", "matched": stop}
    assert stop in tok.decode(got[0]) and got[0] == ids[:len(got[0])]
    assert len(got[0]) <= i + 2


# -- the overlap schedule (on for GPUs; forced here on the CPU, where the logic is the same) ------

def overlap_core(tiny, **kw):
    core = make_core(tiny, **kw)
    core.scheduler.cfg.overlap = True
    return core


@pytest.mark.parametrize("name", ["default", "page16", "max-running-2", "no-radix"])
def test_overlap_schedule_keeps_outputs_exact(tiny, alone, name):
    sched = overlap_core(tiny, **SCENARIOS[name]).scheduler
    for stagger in (0, 3):
        got = drive(sched, [(f"{rid}-{stagger}", ids, p) for rid, ids, p in _requests()],
                    stagger)
        sched.check_accounting()
        for rid, (ids, _) in alone.items():
            assert got[f"{rid}-{stagger}"] == (ids, {"type": "length", "length": MAX_NEW}), rid
    assert sched.counters["overlapped_steps"] > MAX_NEW  # it really chained decode steps
    assert sched.inflight is None and not sched.has_work


def test_overlap_schedule_stops_aborts_and_seeds(tiny, alone):
    sched = overlap_core(tiny).scheduler
    ref = alone["r2"][0]
    p = _prompts()[2]
    # a stop token found one step late still ends the output at the stop token
    got = drive(sched, [("s", p, greedy(stop_token_ids=[ref[5]]))])["s"]
    assert got == (ref[:ref.index(ref[5]) + 1], {"type": "stop", "matched": ref[5]})
    # min_new_tokens masking (not deferrable while it masks) then overlap
    got = drive(sched, [("m", p, greedy(stop_token_ids=[ref[0]], min_new_tokens=3))])["m"]
    assert ref[0] not in got[0][:3]
    # seeded sampling: the same tokens with and without overlap
    params = {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 11,
              "ignore_eos": True}
    plain = make_core(tiny).scheduler
    want = drive(plain, [("x", p, params), ("y", _prompts()[4], params)])
    assert drive(sched, [("x", p, params), ("y", _prompts()[4], params)]) == want
    # penalties and logprobs are not deferrable: they run synchronously, with the same result
    pen = {**greedy(), "repetition_penalty": 1.3, "logprobs": True}
    assert drive(sched, [("r", p, pen)])["r"] == drive(plain, [("r", p, pen)])["r"]
    # abort while a step is in flight
    sched.add_request("a", _prompts()[1], greedy(max_new=50))
    sched.add_request("b", _prompts()[3], greedy(max_new=50))
    for _ in range(6):
        sched.step()
    assert sched.inflight is not None
    assert sched.abort("a")
    done = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish:
                done[r.rid] = (r.finish["type"], len(r.output_ids))
    assert done == {"a": ("abort", done["a"][1]), "b": ("length", 50)}
    sched.check_accounting()


def test_startup_warmup_forwards_leave_no_trace(tiny, alone):
    core = make_core(tiny)
    runner = core.scheduler.runner
    assert runner.warmup([(1, 5), (3, 40), (0, 4)]) == 2  # a shape of 0 requests is skipped
    assert runner.forward_count == {"extend": 0, "decode": 0}
    got = drive(core.scheduler, _requests())
    core.scheduler.check_accounting()
    assert {rid: ids for rid, (ids, _) in got.items()} == \
        {rid: ids for rid, (ids, _) in alone.items()}


def test_overlap_schedule_chains_constrained_batches_with_the_same_tokens(tiny):
    """Structured output under the overlap schedule: forward N+1 is launched before step N
    lands; the masks of N+1 follow token N all the same (core.engine.scheduler.overlap), so every output
    equals the synchronous schedule's, the grammars end their requests, and the steps chain."""
    regex = {"kind": "regex", "value": "[a-z]{3,12}( [a-z]{2,9}){2,5}\\."}
    schema = {"kind": "json_schema", "value": json.dumps({
        "type": "object", "properties": {"a": {"type": "integer"},
                                         "b": {"type": "array", "items": {"type": "string"}}},
        "required": ["a", "b"]})}
    reqs = [("g0", _prompts()[0], {**greedy(60), "ignore_eos": False, "constraint": regex}),
            ("g1", _prompts()[1], {**greedy(60), "ignore_eos": False, "constraint": schema}),
            ("g2", _prompts()[2], {**greedy(60), "ignore_eos": False,
                                   "constraint": {"kind": "json_object", "value": ""}}),
            ("u", _prompts()[3], greedy(30))]  # an unconstrained row in the same batch
    plain = make_core(tiny).scheduler
    assert plain.grammar is not None, "no grammar backend installed here"
    want = drive(plain, reqs)
    sched = overlap_core(tiny).scheduler
    got = drive(sched, reqs)
    assert got == want
    assert sched.counters["overlapped_steps"] > 10
    assert sched.inflight is None and not sched.has_work
    sched.check_accounting()
    assert want["u"][1]["type"] == "length"
    # the grammars end requests themselves (a complete match), also under overlap
    assert [want[g][1]["type"] for g in ("g0", "g1", "g2")].count("stop") >= 1, want


def test_grammars_compile_off_the_step(tiny):
    """A constraint not in the cache compiles on the grammar's thread: the request waits in
    `compiling` while the others keep decoding, then runs exactly as if compiled inline; two
    requests with one constraint share a compile; a failed compile ends its requests with the
    error's status; an abort while compiling leaves nothing behind."""
    from concurrent.futures import Future

    from core.contract.grammar import GrammarError

    regex = {"kind": "regex", "value": "[a-z]{4,9}( [a-z]{3,8}){2,4}\\."}
    want = drive(make_core(tiny).scheduler, [("b", _prompts()[1], {**greedy(40),
                                                                    "ignore_eos": False,
                                                                    "constraint": regex})])["b"]
    sched = make_core(tiny).scheduler
    grammar = sched.grammar
    futures = []
    real_submit = grammar.submit

    def held_submit(c):  # a compile we finish by hand
        fut = Future()
        futures.append((c, fut))
        return fut

    grammar.submit = held_submit
    sched.add_request("a", _prompts()[0], greedy(30))
    sched.add_request("b", _prompts()[1], {**greedy(40), "ignore_eos": False,
                                           "constraint": regex})
    sched.add_request("b2", _prompts()[1], {**greedy(40), "ignore_eos": False,
                                            "constraint": regex})
    assert len(futures) == 1 and [r.rid for r in sched.compiling] == ["b", "b2"]
    for _ in range(5):
        sched.step()
    a = sched.by_id["a"]
    assert len(a.output_ids) >= 4  # decoding went on while the grammar compiled
    assert sched.stats()["compiling"] == 2
    sched.abort("b2")  # aborted while compiling
    futures[0][1].set_result(grammar.compile(futures[0][0]))
    got = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish is not None:
                got[r.rid] = (list(r.output_ids), r.finish)
    assert got["b"] == want
    assert got["b2"][1]["type"] == "abort" and not sched.compiling
    sched.check_accounting()
    # the compiled grammar was cached: the same constraint runs at once now
    sched.add_request("c", _prompts()[2], {**greedy(8), "constraint": regex})
    assert not sched.compiling and len(futures) == 1
    # a compile that fails ends its request with the error's status
    sched.add_request("d", _prompts()[2], {**greedy(8), "constraint": {
        "kind": "regex", "value": "x+y+"}})
    futures[1][1].set_exception(GrammarError("regex: the backend refused it"))
    out = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish is not None:
                out[r.rid] = r.finish
    assert out["d"] == {"type": "abort", "message": "regex: the backend refused it",
                        "status_code": 400}
    assert out["c"]["type"] in ("length", "stop")
    grammar.submit = real_submit
    sched.check_accounting()


class _StopsAfter:
    """A grammar matcher that accepts `k` tokens, then refuses every token; `dead`: its mask
    then allows nothing (a dead end), else it still allows everything (a backend bug)."""

    def __init__(self, k: int, dead: bool):
        self.k, self.dead, self.accepted = k, dead, 0

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0 if self.dead and self.accepted >= self.k else -1

    def accept(self, token):
        if self.accepted >= self.k:
            return False
        self.accepted += 1
        return True

    def is_terminated(self):
        return False

    def reset(self):
        self.accepted = 0

    def close(self):
        pass


def test_a_grammar_dead_end_ends_its_request_with_a_400_naming_it(tiny):
    """A grammar that allows no next token mid-answer (xgrammar on a JSON-schema pattern of
    control characters) ends its request with a 400 naming the constraint and why; a token
    the mask allowed but the grammar refused is a backend bug, a 500 (it was one abort with
    no status, which the server sent as a 200 with finish_reason "abort")."""
    sched = make_core(tiny).scheduler
    assert sched.grammar is not None, "no grammar backend installed here"
    matchers = iter([_StopsAfter(3, dead=True), _StopsAfter(2, dead=False)])
    sched.grammar.cached = lambda c: "compiled"
    sched.grammar.matcher_of = lambda compiled: next(matchers)
    regex = {"kind": "regex", "value": "a+", "source": "response_format.pattern"}
    got = drive(sched, [("dead", _prompts()[0], {**greedy(20), "constraint": regex}),
                        ("bug", _prompts()[1], {**greedy(20), "constraint": regex})])
    ids, fin = got["dead"]
    assert len(ids) == 4 and fin["type"] == "abort" and fin["status_code"] == 400, fin
    assert fin["message"] == ("response_format.pattern: the constraint can never be satisfied: "
                              "after 3 tokens its grammar allows no next token, not even an end")
    ids, fin = got["bug"]
    assert len(ids) == 3 and fin["status_code"] == 500 and "backend bug" in fin["message"], fin
    sched.check_accounting()


# -- jump-forward ---------------------------------------------------------------------------------

JUMP_SCHEMA = {"type": "object", "properties": {
    "identifier_of_the_thing": {"type": "integer"},
    "category_of_the_thing": {"enum": ["alphabetical", "numerical"]},
    "description": {"type": "string", "maxLength": 12}},
    "required": ["identifier_of_the_thing", "category_of_the_thing", "description"],
    "additionalProperties": False}


def _jump_requests():
    choice = {"kind": "choice", "value": json.dumps(["the quick brown fox jumps",
                                                     "the quick brown cat sleeps"])}
    schema = {"kind": "json_schema", "value": json.dumps(JUMP_SCHEMA)}
    regex = {"kind": "regex", "value": "id-[0-9]{2}-fixed-suffix-[a-z]{2,5}\\."}
    return [("c", _prompts()[0], {**greedy(60), "ignore_eos": False, "constraint": choice}),
            ("s", _prompts()[1], {**greedy(90), "ignore_eos": False, "constraint": schema}),
            ("s2", _prompts()[5], {**greedy(90), "ignore_eos": False, "constraint": schema}),
            ("x", _prompts()[2], {**greedy(40), "ignore_eos": False, "constraint": regex}),
            ("x-short", _prompts()[3], {**greedy(7), "ignore_eos": False, "constraint": regex}),
            ("u", _prompts()[4], greedy(30))]  # an unconstrained row beside them


JUMP_SCENARIOS = {"default": {}, "overlap": {}, "page16-chunk16-no-radix": {
    "page_size": 16, "chunked_prefill_size": 16, "disable_radix_cache": True},
    "retraction": {"max_total_tokens": 200, "schedule_conservativeness": 0.05}}


# every scenario with xgrammar, and the overlap one with llguidance, in CI's set (~14 s each);
# llguidance's other scenarios are marked slow
@pytest.mark.parametrize(("name", "backend"), [
    *((n, "xgrammar") for n in sorted(JUMP_SCENARIOS)),
    *(pytest.param(n, "llguidance", marks=() if n == "overlap" else pytest.mark.slow)
      for n in sorted(JUMP_SCENARIOS))])
def test_jump_forward_keeps_greedy_outputs_with_fewer_decode_steps(tiny, backend, name):
    """The fixture's byte-level vocabulary has one tokenization of every text, so the tokens a
    grammar forces are the ones greedy decoding would pick under the mask: outputs must equal
    the run without jump-forward exactly, while the forced tokens are computed by extends
    instead of decode steps (overlap, chunked prefill, no prefix cache, retraction)."""
    from core.plan.checks import missing_packages
    from core.plan.registry import get_registry

    missing = missing_packages(get_registry().get("grammar", backend).caps.requires)
    if missing:
        pytest.skip(f"package {missing[0]} is not installed")
    kw = {"grammar_backend": backend, **JUMP_SCENARIOS[name]}
    plain = make_core(tiny, **kw).scheduler
    want = drive(plain, _jump_requests())
    core = make_core(tiny, enable_jump_forward=True, **kw)
    sched = core.scheduler
    assert sched.cfg.jump_forward
    if name == "overlap":
        sched.cfg.overlap = True
    got = drive(sched, _jump_requests())
    assert got == want
    sched.check_accounting()
    assert sched.inflight is None and not sched.jumped and not sched.has_work
    c = sched.counters
    assert c["jumps"] >= 5 and c["jump_tokens"] >= 60, c
    # each forced token is one decode step fewer (a jump's extend samples the next token)
    assert c["decode_tokens"] <= plain.counters["decode_tokens"] - c["jump_tokens"] + \
        c["retractions"] * 90, (c, plain.counters)
    if name == "retraction":
        assert c["retractions"] > 0
    if name == "overlap":
        assert c["overlapped_steps"] > 5
    assert want["x-short"][1] == {"type": "length", "length": 7}  # a jump stops at the limit
    assert want["c"][1]["type"] == "stop"


def test_jump_forward_abort_and_logprobs(tiny):
    """A request aborted while it waits for its jump's extend gives everything back; one that
    asks for logprobs is never jumped (forced tokens have no model logprobs) and gets one per
    token."""
    pytest.importorskip("xgrammar")
    sched = make_core(tiny, enable_jump_forward=True, grammar_backend="xgrammar").scheduler
    choice = {"kind": "choice", "value": json.dumps(["abcdefghijklmnop", "abcdefghijklmnoq"])}
    sched.add_request("a", _prompts()[0], {**greedy(30), "constraint": choice})
    sched.add_request("u", _prompts()[1], greedy(10))
    while not sched.by_id["a"].output_ids:  # its grammar compiles, then it prefills
        sched.step()
    # it sampled "a", and jumped ahead "bcdefghijklmno" (then a choice of two)
    assert [r.rid for r in sched.jumped] == ["a"] and sched.by_id["a"].output_ids[1:] == \
        list(b"bcdefghijklmno")
    assert sched.abort("a") and not sched.jumped
    while sched.has_work:
        sched.step()
    sched.check_accounting()
    lp = drive(sched, [("l", _prompts()[0], {**greedy(30), "constraint": choice,
                                             "logprobs": True, "top_logprobs": 0})])
    text = bytes(t for t in lp["l"][0] if t < 256)  # the grammar's stop token ends it
    assert sched.counters["jumps"] == 1 and text in (b"abcdefghijklmnop", b"abcdefghijklmnoq")
