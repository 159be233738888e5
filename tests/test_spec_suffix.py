"""The `suffix` proposer (plugins/spec/suffix, issue 33): what it drafts from the request itself
and from earlier requests, its frequency choice and probability cut, the shared cache's bound,
and greedy outputs unchanged through the engine with it (the conformance suite runs on it from
tests/test_spec_decode.py, with every registered proposer)."""

from __future__ import annotations

import pytest

from core.contract.spec import DraftRequest, SpecConfig
from plugins.spec.suffix.proposer import Index, SuffixProposer


def proposer(k: int = 4, lo: int = 1, hi: int = 6, **kw) -> SuffixProposer:
    return SuffixProposer(SpecConfig(num_draft_tokens=k, min_match=lo, max_match=hi,
                                     vocab_size=1000), **kw)


def ask(p: SuffixProposer, rid: str, toks: list[int], prompt_len: int | None = None,
        k: int = 4) -> list[int]:
    return p.propose([DraftRequest(rid, toks, len(toks) if prompt_len is None else prompt_len,
                                   k)])[0]


def test_drafts_from_the_requests_own_tokens():
    p = proposer()
    assert ask(p, "a", [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]) == [4, 5, 9, 9]
    assert ask(p, "b", [7, 8]) == []  # nothing seen after 8
    assert ask(p, "c", []) == [] and ask(p, "d", [5]) == []


def test_drafts_from_an_earlier_requests_output():
    p = proposer()
    prompt = [100, 101, 102]
    out = [11, 12, 13, 14, 15, 16]
    ask(p, "first", prompt + out, prompt_len=3)
    p.reset("first")  # finished: its output goes to the shared cache
    # a new request whose tail is where the earlier output began
    assert ask(p, "second", [500, 501, 11, 12]) == [13, 14, 15, 16]
    # the earlier prompt is not drafted from (only the output and its lead-in contexts)
    assert ask(p, "third", [900, 100, 101]) == []


def test_most_frequent_continuation_then_the_most_recent_and_the_probability_cut():
    p = proposer(k=3, min_prob=0.0)
    for i, nxt in enumerate([5, 5, 6]):  # after [1, 2]: 5 twice, 6 once
        ask(p, f"r{i}", [1, 2, nxt, 40 + i], prompt_len=0)
        p.reset(f"r{i}")
    assert ask(p, "q", [9, 1, 2], k=1) == [5]
    tie = proposer(k=1, min_prob=0.0)
    for i, nxt in enumerate([5, 6]):
        ask(tie, f"r{i}", [1, 2, nxt], prompt_len=0)
        tie.reset(f"r{i}")
    assert ask(tie, "q", [9, 1, 2]) == [6]  # a tie goes to the most recent
    # [1, 2] -> 5 has probability 2/3, then [.., 5] -> 40 or 41 one half each: 1/3 < 0.4
    cut = proposer(k=3, min_prob=0.4)
    for i, nxt in enumerate([5, 5, 6]):
        ask(cut, f"r{i}", [1, 2, nxt, 40 + i], prompt_len=0)
        cut.reset(f"r{i}")
    assert ask(cut, "q", [9, 1, 2]) == [5]


def test_the_shared_cache_is_bounded_and_forgets_the_oldest():
    p = proposer(cache_tokens=10)
    ask(p, "old", [1, 2, 3, 4, 5, 6], prompt_len=0)
    p.reset("old")
    assert ask(p, "q1", [0, 1, 2]) == [3, 4, 5, 6]
    ask(p, "new", [20, 21, 22, 23, 24, 25], prompt_len=0)
    p.reset("new")  # 12 tokens kept > 10: "old" goes, and its counts with it
    assert p.cached_tokens <= 10 and list(p.cached) == ["new"]
    assert ask(p, "q2", [0, 1, 2]) == []
    assert ask(p, "q3", [0, 20, 21]) == [22, 23, 24, 25]


def test_a_retracted_request_is_cached_once():
    p = proposer()
    ask(p, "r", [1, 2, 3, 4], prompt_len=1)
    p.reset("r")  # retracted: its tokens come back
    ask(p, "r", [1, 2, 3, 4, 5, 6], prompt_len=1)
    p.reset("r")  # finished
    node = p.shared.table[(2, 3)]
    assert node[2][4][0] == 1  # counted once, not twice
    assert list(p.cached) == ["r"] and p.cached_tokens == 6


def test_index_removal_restores_the_best_continuation():
    ix = Index(3)
    ix.add([1, 2, 7])
    ix.add([1, 2, 8])
    ix.add([1, 2, 8])
    assert ix.longest([1, 2], 1)[1][0] == 8
    ix.add([1, 2, 8], sign=-1)
    ix.add([1, 2, 8], sign=-1)
    assert ix.longest([1, 2], 1)[1][0] == 7
    ix.add([1, 2, 7], sign=-1)
    assert ix.longest([1, 2], 1) == (0, None) and ix.table == {}


def test_a_long_request_keeps_a_bounded_own_index():
    p = proposer(lookback=50)
    toks = list(range(300))
    for n in range(10, 300, 7):
        ask(p, "long", toks[:n])
    own = p.own["long"]
    assert own.base >= 300 - 2 * 50 and len(own.index.table) <= 6 * 2 * 50


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min"):
        proposer(lo=4, hi=2)
    with pytest.raises(ValueError, match="min_prob"):
        proposer(min_prob=1.5)


def test_plan_names_suffix_by_sglang_and_vllm_spellings():
    from core.engine.worker import make_plan
    from core.plan.args import make_server_args

    plan = make_plan(make_server_args(speculative_algorithm="SUFFIX"))[1]
    assert plan.spec_proposer == "suffix"
    v = make_server_args(speculative_config='{"method": "suffix_decoding", '
                                            '"num_speculative_tokens": 3}')
    plan = make_plan(v)[1]
    assert (plan.spec_proposer, plan.spec_draft_tokens) == ("suffix", 3)


# -- through the engine (the tiny random Llama of tests/test_spec_decode.py) -------------------

from test_spec_decode import _requests, drive, make_core, plain, tiny  # noqa: E402,F401,F811


@pytest.mark.parametrize("extra", [{}, {"chunked_prefill_size": 16, "page_size": 4}])
def test_greedy_outputs_identical_with_suffix_and_earlier_outputs_drafted(tiny, plain, extra):  # noqa: F811
    core = make_core(tiny, speculative_algorithm="suffix", **extra)
    sched = core.scheduler
    assert drive(sched, _requests(), check_every_step=True) == plain
    first = sched.stats()["spec_num_accepted_tokens"]
    assert any(n.startswith("suffix proposer") for n in core.info.notes)
    # the same prompts again under new ids: their outputs are now in the shared cache, so
    # drafts follow them from the first output token (more accepted than the first time)
    again = [(f"again-{rid}", ids, p) for rid, ids, p in _requests()]
    got = drive(sched, again, check_every_step=True)
    assert {rid.removeprefix("again-"): v for rid, v in got.items()} == plain
    s = sched.stats()
    second = s["spec_num_accepted_tokens"] - first
    assert second > first, (first, second)
    assert s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
    sched.check_accounting()
