"""The speculation governor (core.engine.scheduler.governor, issue 33 item 3): drafts per
request and step from each request's acceptance and the fitted cost of a drafted token, the
probe that lets a cut request recover, vLLM's disable_by_batch_size, the flags, and greedy
outputs unchanged through the engine with it on."""

from __future__ import annotations

import pytest

from core.engine.scheduler.governor import PROBE_EVERY, Governor, StepCost, expected_accepted
from core.plan.args import make_server_args


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4.0
    assert expected_accepted(0.0, 4) == 0.0


def test_step_cost_fits_a_line_and_prices_a_draft():
    cost = StepCost()
    assert cost.draft_price(4) == 0.0  # nothing seen: drafts assumed free
    for t in (1, 5, 9, 1, 5, 9):
        cost.add(t, 0.010 + 0.002 * t)
    t0, c = cost.line()
    assert t0 == pytest.approx(0.010) and c == pytest.approx(0.002)
    # one drafted token in a 4-request step: 0.002 s against 0.018 s for 4 emitted tokens
    assert cost.draft_price(4) == pytest.approx(0.002 * 4 / 0.018)
    one_size = StepCost()
    for _ in range(5):
        one_size.add(3, 0.01)
    assert one_size.line() is None and one_size.draft_price(3) == 0.0


def costly(c: float = 0.002, t0: float = 0.010) -> Governor:
    gov = Governor()
    for t in (1, 2, 3, 4, 5):
        gov.cost.add(t, t0 + c * t)
    return gov


def test_poor_acceptance_is_cut_and_probed_good_acceptance_keeps_its_drafts():
    gov = costly(c=0.004)  # a drafted token costs ~0.29 tokens of a plain 1-request step
    for _ in range(10):
        gov.observe("good", 4, 4)
        gov.observe("bad", 4, 0)
    assert gov.budgets(["good"], [4]) == [4]
    got = [gov.budgets(["bad"], [4])[0] for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and set(got) == {0, 1}  # one probe draft every PROBE_EVERY steps
    assert got[PROBE_EVERY - 1] == 1
    # a cap is never exceeded, and a capped-out request asks for nothing
    assert gov.budgets(["good", "bad"], [2, 0]) == [2, 0]


def test_middling_acceptance_gets_fewer_drafts_as_they_cost_more():
    cheap, dear = costly(c=0.0005), costly(c=0.01)
    for gov in (cheap, dear):
        for _ in range(10):
            gov.observe("r", 4, 2)  # about half of the drafts accepted
    assert cheap.budgets(["r"], [6]) > dear.budgets(["r"], [6])
    free = Governor()
    free.observe("r", 4, 1)
    assert free.budgets(["r"], [6]) == [6]  # no cost measured yet: drafts are free


def test_exempt_requests_keep_their_caps_but_not_past_disable_by_batch_size():
    gov = Governor(disable_batch=2)
    gov.cost.draft_price = lambda n: 100.0  # no draft pays
    assert gov.budgets(["a", "b"], [4, 4], [True, False]) == [4, 0]
    assert gov.budgets(["a", "b", "c"], [4, 4, 4], [True, True, True]) == [0, 0, 0]


def test_off_passes_the_caps_and_disable_by_batch_size_stops_big_steps():
    off = Governor(on=False)
    off.observe("r", 4, 0)
    assert off.budgets(["r"], [4]) == [4]
    gov = Governor(on=False, disable_batch=2)
    assert gov.budgets(["a", "b"], [4, 4]) == [4, 4]
    assert gov.budgets(["a", "b", "c"], [4, 4, 4]) == [0, 0, 0]
    gov.forget("a")
    assert "a" not in gov.seen


def test_flags_and_vllm_key():
    args = make_server_args(speculative_algorithm="ngram", speculative_governor="on",
                            speculative_config='{"method": "ngram", "disable_by_batch_size": 8}')
    assert (args.speculative_governor, args.speculative_disable_by_batch_size) == ("on", 8)
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        make_server_args(speculative_governor="on")
    with pytest.raises(ValueError, match="must be >= 1"):
        make_server_args(speculative_algorithm="ngram", speculative_disable_by_batch_size=0)


from test_spec_decode import _requests, drive, make_core, plain, tiny  # noqa: E402,F401,F811


def plan_notes(tiny, **kw) -> list[str]:  # noqa: F811
    from core.engine.worker import make_plan

    return make_plan(make_server_args(model_path=tiny[0], dtype="float32", **kw))[1].notes


def test_greedy_outputs_unchanged_with_the_governor_on(tiny, plain):  # noqa: F811
    core = make_core(tiny, speculative_algorithm="ngram", speculative_governor="on")
    sched = core.scheduler
    assert sched.spec.governor.on
    assert drive(sched, _requests(), check_every_step=True) == plain
    s = sched.stats()
    assert s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
    assert len(sched.spec.governor.cost.samples) > 0  # steps were timed
    assert any(n.startswith("speculation governor on") for n in plan_notes(
        tiny, speculative_algorithm="ngram", speculative_governor="on"))
    sched.check_accounting()


def test_disable_by_batch_size_keeps_outputs_and_drafts_only_small_steps(tiny, plain):  # noqa: F811
    full = make_core(tiny, speculative_algorithm="ngram").scheduler
    assert drive(full, _requests()) == plain
    core = make_core(tiny, speculative_algorithm="ngram", speculative_disable_by_batch_size=1)
    sched = core.scheduler
    assert drive(sched, _requests(), check_every_step=True) == plain
    assert sched.stats()["spec_num_drafts"] < full.stats()["spec_num_drafts"]
    assert any("more than 1 running requests" in n for n in plan_notes(
        tiny, speculative_algorithm="ngram", speculative_disable_by_batch_size=1))


def test_seeded_sampled_requests_are_exempt_and_repeat_under_the_governor(tiny):  # noqa: F811
    """The governor's cuts follow measured step times, so they differ from run to run; a
    seeded request at temperature > 0 is exempt (its drafts decide what its generator draws)
    and gives the same tokens when sent again, while a greedy request's drafts are cut.
    --speculative-disable-by-batch-size still holds for seeded requests."""
    import random

    from test_spec_decode import _prompts

    sched = make_core(tiny, speculative_algorithm="ngram", speculative_governor="on").scheduler
    gov = sched.spec.governor
    rng = random.Random(0)
    gov.cost.draft_price = lambda n: rng.uniform(0.0, 1.0)  # step timings as noise would give
    seeded = {"max_new_tokens": 16, "temperature": 0.8, "top_k": 20, "ignore_eos": True,
              "seed": 7}
    outs = [drive(sched, [(f"{run}{i}", p, seeded) for i, p in enumerate(_prompts()[:3])])
            for run in "ab"]
    s = sched.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_governor_cut"] == 0
    assert [v for _, v in sorted(outs[0].items())] == [v for _, v in sorted(outs[1].items())]

    gov.cost.draft_price = lambda n: 100.0  # no draft pays: greedy requests get none but probes
    drive(sched, [(f"g{i}", p, {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
                  for i, p in enumerate(_prompts()[:3])])
    assert sched.stats()["spec_governor_cut"] > 0
    sched.check_accounting()

    small = make_core(tiny, speculative_algorithm="ngram", speculative_governor="on",
                      speculative_disable_by_batch_size=1).scheduler
    drive(small, [(f"d{i}", p, seeded) for i, p in enumerate(_prompts()[:3])])
    assert small.stats()["spec_num_draft_tokens"] == 0  # three running in every step
