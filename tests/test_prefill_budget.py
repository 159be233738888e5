"""The prefill budget (core.engine.scheduler.budget, --decode-itl-target-ms): while requests
decode, each step's extend stays within what the measured extend rate fits into the target after
the decode step; without decodes chunks are full; outputs never change.

The step times come from a fake clock that the wrapped runner advances by a cost model (an
extend of n tokens: EXT_FIXED + n * EXT_PER_TOKEN; a decode step: DECODE), so nothing depends on
this machine's speed.
"""

from __future__ import annotations

import math

import pytest
from model_fixtures import write_tiny_model

from core.engine.loader import load_model
from core.engine.scheduler.budget import GRAIN, PrefillBudget
from core.engine.worker import _apply, build_engine_core, make_plan
from core.messages import PrefillBudget as PrefillBudgetMsg
from core.plan.args import make_server_args

CHUNK = 512
TARGET_MS = 8.0
EXT_FIXED, EXT_PER_TOKEN, DECODE = 0.5e-3, 0.02e-3, 3e-3  # seconds
LONG = 700  # prompt tokens: 2 full chunks, several budgeted steps


def _ids(n: int, salt: int) -> list[int]:
    return [(11 * salt + 7 * j) % 250 + 3 for j in range(n)]


def greedy(max_new: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama",
                                max_position_embeddings=1024))
    args, plan, _, registry = make_plan(make_server_args(model_path=path, dtype="float32"))
    return path, load_model(args, plan, registry)


def make_core(tiny, **kw):
    path, loaded = tiny
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("chunked_prefill_size", CHUNK)
    args, plan, spec, registry = make_plan(make_server_args(model_path=path, dtype="float32",
                                                            **kw))
    return build_engine_core(args, plan, spec, registry, loaded)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def timed(sched, floor: int = 32) -> list[tuple[int, int | None, bool]]:
    """Put the scheduler's budget on a fake clock the runner advances by the cost model; returns
    the log of extends: (tokens, the cap that step had, whether requests were decoding)."""
    clock, runner, budget = FakeClock(), sched.runner, sched.budget
    budget.clock, budget.floor = clock, floor
    log: list[tuple[int, int | None, bool]] = []
    extend, decode = runner.extend, runner.decode

    def timed_extend(rows, prefix, tokens, *a, **k):
        n = sum(len(t) for t in tokens)
        log.append((n, budget.cap(bool(sched.running)), bool(sched.running)))
        out = extend(rows, prefix, tokens, *a, **k)
        clock.t += EXT_FIXED + n * EXT_PER_TOKEN
        return out

    def timed_decode(*a, **k):
        out = decode(*a, **k)
        clock.t += DECODE
        return out

    runner.extend, runner.decode = timed_extend, timed_decode
    return log


def run(sched, late: int = 3) -> tuple[dict[str, list[int]], list[int]]:
    """Two short requests decode; at step `late` a long prompt arrives. Returns every request's
    output and the long prompt's cached tokens after each step."""
    sched.add_request("a", _ids(30, 1), greedy(60))
    sched.add_request("b", _ids(20, 2), greedy(60))
    out, progress, step = {}, [], 0
    while sched.has_work or step <= late:
        if step == late:
            sched.add_request("long", _ids(LONG, 3), greedy(8))
        for r in sched.step():
            if r.finish is not None:
                out[r.rid] = list(r.output_ids)
        if "long" in sched.by_id:
            progress.append(sched.by_id["long"].kv_len)
        step += 1
        assert step < 1000
    sched.check_accounting()
    return out, progress


def test_budget_formula():
    b = PrefillBudget(50.0, 4096, clock=FakeClock())
    assert b.cap(True) is None  # nothing measured: the chunk
    b.extend_timed(1000, 0.1)  # 0.1 ms a token
    b.decode_timed(0.01)
    assert b.cap(False) is None  # no decodes: the chunk
    assert b.cap(True) == 384  # (50 - 10) ms / 0.1 ms = 400, down to a multiple of GRAIN
    assert 384 % GRAIN == 0
    b.decode_timed(0.1)  # a slow decode (EMA 28 ms): prefill gets as long as decoding
    assert b.cap(True) == int(b.decode_s / b.seconds_per_token) // GRAIN * GRAIN
    slow = PrefillBudget(50.0, 4096)
    slow.extend_timed(10, 1.0)  # 0.1 s a token: the floor
    assert slow.cap(True) == 256
    assert PrefillBudget(50.0, 128).computed() is None
    small = PrefillBudget(50.0, 128)
    small.extend_timed(10, 1.0)
    assert small.cap(True) == 128  # the floor never exceeds the chunk
    fast = PrefillBudget(50.0, 4096)
    fast.extend_timed(10_000, 0.01)
    assert fast.cap(True) == 4096  # the chunk fits: no cut
    for off in (PrefillBudget(0, 4096), PrefillBudget(None, 4096), PrefillBudget(50.0, None)):
        off.extend_timed(1000, 1.0)
        assert not off.on and off.cap(True) is None
    tp = PrefillBudget(50.0, 4096)
    tp.by_message, tp.shared = True, 640
    tp.extend_timed(10, 1.0)
    assert tp.cap(True) == 640 and tp.cap(False) is None  # rank 0's, whatever this clock says


def test_decoding_steps_stay_within_budget_and_prompt_finishes(tiny):
    core = make_core(tiny, decode_itl_target_ms=TARGET_MS)
    sched = core.scheduler
    log = timed(sched)
    out, progress = run(sched)
    assert set(out) == {"a", "b", "long"} and len(out["long"]) == 8
    budgeted = [(n, cap) for n, cap, decoding in log if decoding]
    assert len(budgeted) >= 4, log
    for n, cap in budgeted:
        assert cap is not None and n <= cap < CHUNK, log
        # the modelled step: the decode step and this extend, within the target
        assert DECODE + EXT_FIXED + n * EXT_PER_TOKEN <= TARGET_MS / 1e3 + 1e-9, log
    # every step moved the long prompt on until it was cached (no starvation)
    filling = [p for p in progress if p < LONG]
    assert all(b > a for a, b in zip(filling, filling[1:], strict=False)), progress
    st = sched.stats()
    assert st["prefill_capped_steps"] >= 3
    assert st["prefill_budget_target_ms"] == TARGET_MS
    assert 0 < st["prefill_budget_tokens"] < CHUNK
    assert st["prefill_budget_decode_ms"] == pytest.approx(DECODE * 1e3)
    # converged where t_extend(cap) fits the target: (8 - 3 - 0.5) ms / 0.02 ms = 225 -> 192
    assert budgeted[-1][1] == 192


def test_outputs_equal_with_the_budget_on_and_off(tiny):
    on = make_core(tiny, decode_itl_target_ms=TARGET_MS)
    log = timed(on.scheduler)
    got_on, _ = run(on.scheduler)
    assert any(decoding and n < CHUNK for n, _, decoding in log)  # the budget did cut
    off = make_core(tiny, decode_itl_target_ms=0)
    log_off = timed(off.scheduler)
    got_off, _ = run(off.scheduler)
    assert got_on == got_off
    assert max(n for n, _, decoding in log_off if decoding) == CHUNK  # off: full chunks
    assert off.scheduler.stats()["prefill_capped_steps"] == 0


def test_full_chunks_without_decodes(tiny):
    core = make_core(tiny, decode_itl_target_ms=TARGET_MS)
    sched = core.scheduler
    log = timed(sched)
    sched.budget.extend_timed(10, 1.0)  # measured slow: a cap would be the floor
    sched.add_request("long", _ids(LONG, 3), greedy(2))
    while sched.has_work:
        sched.step()
    assert [n for n, _, _ in log] == [CHUNK, LONG - CHUNK]
    assert sched.stats()["prefill_capped_steps"] == 0


def test_budget_keeps_priority_order(tiny):
    core = make_core(tiny, decode_itl_target_ms=TARGET_MS, enable_priority_scheduling=True)
    sched = core.scheduler
    timed(sched)
    sched.add_request("a", _ids(30, 1), greedy(40))
    sched.step()
    sched.step()
    sched.add_request("low", _ids(400, 4), greedy(2), priority=0)
    sched.add_request("high", _ids(400, 5), greedy(2), priority=5)
    sched.step()
    assert sched.chunked is not None and sched.chunked.rid == "high"
    assert sched.by_id["low"].kv_len == 0
    while sched.has_work:
        sched.step()
    sched.check_accounting()


def test_rank0_budget_message_pins_the_cap(tiny):
    core = make_core(tiny, decode_itl_target_ms=TARGET_MS)
    budget = core.scheduler.budget
    budget.by_message = True
    _apply(core, PrefillBudgetMsg(128), None)
    budget.extend_timed(10, 1.0)
    assert budget.cap(True) == 128


def test_engine_notes_say_the_budget(tiny):
    assert any("prefill budget: while requests decode" in n and "8 ms" in n
               for n in make_core(tiny, decode_itl_target_ms=TARGET_MS).info.notes)
    default = make_core(tiny)  # the offline Engine's default: off
    assert not default.scheduler.budget.on
    assert any("prefill budget off" in n for n in default.info.notes)
    assert any("prefill budget off: chunked prefill is off" in n
               for n in make_core(tiny, chunked_prefill_size=-1).info.notes)


@pytest.mark.parametrize("value,match", [
    (-1, r"must be a number of milliseconds in \[0, 60000\]"),
    (math.nan, r"milliseconds in \[0, 60000\]"),
    (1e6, r"milliseconds in \[0, 60000\]"),
])
def test_flag_validation(value, match):
    with pytest.raises(ValueError, match=match):
        make_server_args(decode_itl_target_ms=value)


def test_core_serve_defaults_to_50_ms_on_accelerators_the_engine_and_cpus_to_off():
    from core.plan.args import SERVE_ITL_TARGET_MS, serving_defaults

    assert make_server_args().decode_itl_target_ms is None  # the engine: off
    assert serving_defaults(make_server_args()).decode_itl_target_ms == SERVE_ITL_TARGET_MS == 50
    assert serving_defaults(make_server_args(), "cuda").decode_itl_target_ms == 50
    assert serving_defaults(make_server_args(), "cpu").decode_itl_target_ms is None  # CPU: off
    given = make_server_args(decode_itl_target_ms=0)
    assert serving_defaults(given).decode_itl_target_ms == 0  # a user's setting stands
    no_chunks = make_server_args(chunked_prefill_size=-1)
    assert serving_defaults(no_chunks).decode_itl_target_ms is None


def test_flag_needs_chunked_prefill():
    with pytest.raises(ValueError, match=r"cuts prefill chunks, but chunked prefill is off"):
        make_server_args(decode_itl_target_ms=50, chunked_prefill_size=-1)
    make_server_args(decode_itl_target_ms=0, chunked_prefill_size=-1)  # off: no conflict
    args = make_server_args(decode_itl_target_ms=30)
    assert args.decode_itl_target_ms == 30


def test_server_figures_metrics_and_replicas_carry_the_budget():
    from core.frontend import router
    from core.frontend.serving import _figures
    from core.server.metrics import ServerMetrics

    stats = {"running": 1, "prefill_budget_target_ms": 50.0, "prefill_budget_tokens": 1408,
             "prefill_capped_steps": 7, "prefill_budget_extend_tok_s": 45000.0,
             "prefill_budget_decode_ms": 14.2}
    f = _figures(stats)
    assert (f["prefill_budget_tokens"], f["prefill_capped_steps"]) == (1408, 7)
    text = ServerMetrics().render(f, True)
    assert "core_prefill_budget_tokens 1408\n" in text
    assert "core_prefill_capped_steps_total 7\n" in text
    assert "# TYPE core_prefill_capped_steps_total counter" in text
    total = router.merge_stats([stats, {**stats, "prefill_budget_tokens": 1344}])
    assert total["prefill_capped_steps"] == 14  # counts add up
    assert total["prefill_budget_target_ms"] == 50.0  # the same everywhere: kept
    assert "prefill_budget_tokens" not in total  # differs per replica: in `replicas` only
