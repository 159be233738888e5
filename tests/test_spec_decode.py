"""Speculative decoding (issue 33, first slice): the ngram proposer, the flags and the plan,
exact verification in the scheduler (greedy outputs identical with speculation on and off;
pages and the prefix cache consistent), rejection sampling keeping the target distribution,
the counters, and the proposers' conformance suite over every registered proposer."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from model_fixtures import write_tiny_model

from conformance.spec_suite import *  # noqa: F401,F403 - the suite, over every proposer
from core.contract.spec import DraftRequest, SpecConfig
from core.engine.loader import load_model
from core.engine.sampling import Sampler, SamplingParams, SamplingState
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args
from core.plan.checks import check_spec
from core.plan.plan import ResolveError
from core.plan.registry import get_registry
from core.server.metrics import ServerMetrics
from plugins.spec.ngram.proposer import NgramProposer

# -- the ngram proposer --------------------------------------------------------------------------


def ngram(k: int = 4, lo: int = 1, hi: int = 4, **kw: int) -> NgramProposer:
    return NgramProposer(SpecConfig(num_draft_tokens=k, min_match=lo, max_match=hi), **kw)


def test_ngram_drafts_the_continuation_of_the_longest_latest_match():
    p = ngram()
    # suffix [1, 2, 3] occurred at 0: what followed it
    assert p.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 4) == [4, 5, 9, 1]
    assert p.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]
    # the longest suffix wins over a later shorter one: [8, 3] matches at 1, [3] later at 5
    assert p.lookup([0, 8, 3, 6, 7, 3, 5, 8, 3], 2) == [6, 7]
    # among equal lengths the latest occurrence
    assert p.lookup([5, 1, 5, 2, 9, 5], 1) == [2]
    # a draft may be shorter than asked near the end
    assert p.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # no repeat, nothing asked, nothing to match: no draft
    assert p.lookup([1, 2, 3, 4, 5], 4) == []
    assert p.lookup([1, 2, 1], 0) == []
    assert p.lookup([], 4) == [] and p.lookup([5], 4) == []


def test_ngram_min_match_and_lookback_bound_the_search():
    toks = [1, 2, 9, 7, 3, 2]  # only a 1-token match ([2] at 1)
    assert ngram(lo=1).lookup(toks, 2) == [9, 7]
    assert ngram(lo=2).lookup(toks, 2) == []
    # a match older than the look-back window is not seen
    old = [4, 5, 6] + list(range(100, 200)) + [4, 5]
    assert ngram(lookback=200).lookup(old, 1) == [6]
    assert ngram(lookback=50).lookup(old, 1) == []
    with pytest.raises(ValueError, match="min"):
        ngram(lo=3, hi=2)


def test_ngram_propose_honours_each_request_bound():
    p = ngram(k=3)
    reqs = [DraftRequest("a", [1, 2, 3, 1, 2], 5, 8), DraftRequest("b", [1, 2, 3, 1, 2], 5, 1),
            DraftRequest("c", [], 0, 3)]
    assert p.propose(reqs) == [[3, 1, 2], [3], []]


# -- flags and the plan --------------------------------------------------------------------------


def test_verify_steps_replay_decode_graphs_where_the_decode_backend_declares_rows(model_spec):
    """On a GPU profile with graphs, verify steps run as decode rows in the graphs (triton
    declares verify_rows); a decode backend without graphs, or --disable-cuda-graph, keeps the
    eager extend, and the plan says which and why."""
    from core.plan.devices import PROFILES
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve

    spec, test_registry = model_spec("llama-3.1-8b"), build_registry()
    on = resolve(spec, PROFILES["h200"], make_server_args(speculative_algorithm="ngram"),
                 test_registry)
    assert on.decode_attention == "triton" and on.spec_verify_graphs
    assert any("verify steps replay the decode graphs as decode rows" in n for n in on.notes)
    for extra, why in (({"attention_backend": "torch_native"}, "no decode graphs"),
                       ({"disable_cuda_graph": True}, "no decode graphs")):
        off = resolve(spec, PROFILES["h200"], make_server_args(
            speculative_algorithm="ngram", **extra), test_registry)
        assert not off.spec_verify_graphs
        assert any("verify steps run eagerly" in n and why in n for n in off.notes), off.notes
    # the CPU: cpu_c declares verify_rows and the CPU platform captures (graphs of C calls)
    cpu = make_plan(make_server_args(speculative_algorithm="ngram"))[1]
    assert cpu.spec_verify_graphs == cpu.cuda_graph
    assert cpu.spec_verify_graphs == cpu.decode_attention.startswith("cpu_c"), cpu.notes
    assert not make_plan(make_server_args())[1].spec_verify_graphs  # no speculation


def test_flags_sglang_names_case_insensitive_and_vllm_config():
    a = make_server_args(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                         speculative_ngram_min_match_window_size=2,
                         speculative_ngram_max_match_window_size=5)
    plan = make_plan(a)[1]
    assert plan.spec_proposer == "ngram" and plan.spec_draft_tokens == 3
    assert any("speculative decoding: ngram" in n for n in plan.notes)
    v = make_server_args(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}))
    assert (v.speculative_algorithm, v.speculative_num_draft_tokens,
            v.speculative_ngram_min_match_window_size,
            v.speculative_ngram_max_match_window_size) == ("ngram", 4, 1, 4)
    # the same value twice is fine; a contradiction, an unknown key, bad JSON are refused
    make_server_args(speculative_algorithm="ngram", speculative_config='{"method": "NGRAM"}')
    bad = [({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 2,
             "speculative_config": '{"method": "ngram", "num_speculative_tokens": 5}'},
            "contradicts"),
           ({"speculative_config": '{"method": "ngram", "draft_tensor_parallel_size": 1}'},
            "not supported"),
           ({"speculative_config": '{"num_speculative_tokens": 5}'}, "needs \"method\""),
           ({"speculative_config": "{method"}, "not JSON"),
           ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": "4"}'},
            "integer"),
           ({"speculative_num_draft_tokens": 4}, "needs --speculative-algorithm"),
           ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, "1..64"),
           ({"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 5,
             "speculative_ngram_max_match_window_size": 2}, "min <= max")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            make_server_args(**kw)


@pytest.mark.parametrize("name", ["eagle", "EAGLE3", "NextN"])
def test_algorithms_not_built_yet_are_refused_as_such(name):
    with pytest.raises(ResolveError, match="not implemented yet") as e:
        make_plan(make_server_args(speculative_algorithm=name))
    assert "ngram" in str(e.value)


def test_unknown_algorithm_and_incompatible_settings_are_refused():
    with pytest.raises(ResolveError, match="unknown speculative proposer 'nope'") as e:
        make_plan(make_server_args(speculative_algorithm="nope"))
    assert "registered speculative proposers: ngram" in str(e.value)
    with pytest.raises(ResolveError, match="does not fit") as e:
        make_plan(make_server_args(speculative_algorithm="ngram",
                                   speculative_num_draft_tokens=40))
    assert "at most 16 draft tokens" in str(e.value)
    caps = get_registry().get("spec", "ngram").caps
    device = make_plan(make_server_args())[1].device
    assert check_spec(caps, device, num_draft_tokens=4, tp_size=1) == []
    assert any("tensor parallelism" in r
               for r in check_spec(caps, device, num_draft_tokens=4, tp_size=3))
    with pytest.raises(ResolveError, match="tensor parallelism"):
        make_plan(make_server_args(speculative_algorithm="ngram", tp_size=3))


def test_core_resolve_shows_the_proposer(capsys):
    from core.cli import main

    assert main(["resolve", "--speculative-algorithm", "Ngram"]) in (0, None)
    out = capsys.readouterr().out
    assert "speculative        ngram, 4 draft tokens" in out
    assert "speculative proposer:" in out and "* ngram" in out


# -- verification in the scheduler, on a tiny random Llama ---------------------------------------

MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama"))
    args, plan, _, registry = make_plan(make_server_args(model_path=path, dtype="float32"))
    return path, load_model(args, plan, registry)


def make_core(tiny, **kw):
    path, loaded = tiny
    kw.setdefault("max_total_tokens", 2048)
    if kw.get("speculative_algorithm"):  # counted drafts: no timing-driven cuts unless asked
        kw.setdefault("speculative_governor", "off")
    args, plan, spec, registry = make_plan(make_server_args(model_path=path, dtype="float32",
                                                            **kw))
    return build_engine_core(args, plan, spec, registry, loaded)


def drive(sched, requests, check_every_step: bool = False):
    for rid, ids, params in requests:
        sched.add_request(rid, ids, params)
    out, steps = {}, 0
    deadline = time.monotonic() + 300
    while sched.has_work:
        touched = sched.step()
        for r in touched:
            if r.finish is not None:
                out[r.rid] = (list(r.output_ids), r.finish)
        if not touched and sched.compiling:  # a grammar compile (its own process)
            assert time.monotonic() < deadline, "a grammar compile never finished"
            time.sleep(sched.poll_timeout())
            continue
        if check_every_step:
            sched.check_accounting()
        steps += 1
        assert steps < 5000
    return out


def _prompts():
    block = [11, 42, 7, 99, 5, 63, 18]
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 40, 9))] \
        + [block * 5, [3, 4] * 20 + [77], list(range(20, 60)) + list(range(20, 35))]


def greedy(max_new=MAX_NEW, **kw):
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, **kw}


def _requests(**kw):
    return [(f"r{i}", p, greedy(**kw)) for i, p in enumerate(_prompts())]


@pytest.fixture(scope="module")
def plain(tiny):
    return drive(make_core(tiny).scheduler, _requests())


SPEC = {"speculative_algorithm": "ngram"}
SCENARIOS = {
    "default": {},
    "chunk16": {"chunked_prefill_size": 16},
    "page16-no-radix": {"page_size": 16, "disable_radix_cache": True},
    "page4-chunk8": {"page_size": 4, "chunked_prefill_size": 8},
    "max-running-2": {"max_running_requests": 2},
    "drafts-1": {"speculative_num_draft_tokens": 1},
    "drafts-8-match-2": {"speculative_num_draft_tokens": 8,
                         "speculative_ngram_min_match_window_size": 2},
}
SLOW_SCENARIOS = ("page16-no-radix", "max-running-2", "drafts-1")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in SLOW_SCENARIOS else n for n in sorted(SCENARIOS)])
def test_greedy_outputs_identical_with_speculation(tiny, plain, name):
    core = make_core(tiny, **SPEC, **SCENARIOS[name])
    sched = core.scheduler
    got = drive(sched, _requests(), check_every_step=True)
    assert got == plain
    s = sched.stats()
    assert s["spec_num_accepted_tokens"] > 0, s
    assert s["spec_num_drafts"] > 0 and s["spec_num_draft_tokens"] >= s["spec_num_drafts"]
    assert s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
    # fewer forwards than tokens: the point of it
    fc = sched.runner.forward_count
    assert fc.get("verify", 0) + fc["decode"] < MAX_NEW * len(plain)
    assert any("overlap schedule" in n for n in core.info.notes)
    assert any(n.startswith("ngram proposer") for n in core.info.notes)
    sched.check_accounting()


def test_retraction_with_speculation_keeps_outputs(tiny, plain):
    sched = make_core(tiny, **SPEC, max_total_tokens=200).scheduler
    got = drive(sched, _requests(), check_every_step=True)
    assert got == plain
    assert sched.stats()["retractions"] > 0
    sched.check_accounting()


class Recording:
    """A proposer wrapper that records what it was asked and told."""

    def __init__(self, inner):
        self.inner, self.asked, self.observed, self.resets = inner, [], [], []

    def propose(self, requests):
        self.asked += [(r.rid, len(r.tokens), r.max_tokens) for r in requests]
        return self.inner.propose(requests)

    def observe(self, rid, drafted, accepted):
        self.observed.append((rid, drafted, accepted))

    def reset(self, rid):
        self.resets.append(rid)


def test_max_new_tokens_cut_inside_an_accepted_run(tiny, plain):
    """A request whose output repeats (drafts accepted) stops at max_new_tokens exactly: no
    draft is asked for past it, nothing is emitted past it."""
    for max_new in (1, 2, 5, 11, 13):
        core = make_core(tiny, **SPEC, speculative_num_draft_tokens=8)
        sched = core.scheduler
        rec = Recording(sched.spec.proposer)
        sched.spec.proposer = rec
        prompt = _prompts()[3]
        got = drive(sched, [("m", prompt, greedy(max_new))])["m"]
        assert got[0] == plain["r3"][0][:max_new]
        assert got[1] == {"type": "length", "length": max_new}
        for _, n_tokens, asked in rec.asked:  # room left before max_new, less the own token
            assert asked <= max_new - (n_tokens - len(prompt)) - 1
        assert rec.resets == ["m"]
        sched.check_accounting()
    assert sum(a for _, _, a in rec.observed) > 0


def test_stop_token_inside_an_accepted_run_and_min_new_tokens(tiny, plain):
    ref = plain["r3"][0]
    tok = ref[9]
    for kw in ({"stop_token_ids": [tok]}, {"stop_token_ids": [tok], "min_new_tokens": 12}):
        want = drive(make_core(tiny).scheduler, [("s", _prompts()[3], greedy(**kw))])["s"]
        sched = make_core(tiny, **SPEC).scheduler
        got = drive(sched, [("s", _prompts()[3], greedy(**kw))])["s"]
        assert got == want
        if "min_new_tokens" not in kw:
            assert got == (ref[:ref.index(tok) + 1], {"type": "stop", "matched": tok})
        else:
            assert tok not in got[0][:12]
        sched.check_accounting()


def test_stop_strings_inside_an_accepted_run(tiny, plain):
    """A stop string completed by an accepted draft ends the output at that token, as without
    speculation (the worker checks each emitted token)."""
    core = make_core(tiny, **SPEC)
    tok = core.loaded.tokenizer
    cases = 0
    for rid, (ids, _) in sorted(plain.items()):
        hits = [i for i in range(3, len(ids) - 1) if all(32 <= t < 127 for t in ids[i:i + 2])]
        if not hits:
            continue
        stop = tok.decode(ids[hits[0]:hits[0] + 2])
        params = greedy(stop=[stop])
        prompt = _prompts()[int(rid[1:])]
        want = drive(make_core(tiny).scheduler, [("x", prompt, params)])["x"]
        got = drive(core.scheduler, [("x", prompt, params)])["x"]
        assert got == want and got[1] == {"type": "stop", "matched": stop}
        cases += 1
    assert cases, "no printable pair in any output (fixture changed?)"
    core.scheduler.check_accounting()


def test_abort_mid_generation_frees_everything(tiny, plain):
    sched = make_core(tiny, **SPEC).scheduler
    reqs = _requests()
    for rid, ids, p in reqs:
        sched.add_request(rid, ids, p)
    for _ in range(6):
        sched.step()
    assert sched.stats()["spec_verify_steps"] > 0
    assert sched.abort("r3") and sched.abort("r0")
    sched.check_accounting()
    done = {}
    while sched.has_work:
        for r in sched.step():
            if r.finish:
                done[r.rid] = (list(r.output_ids), r.finish)
    assert done["r3"][1]["type"] == "abort" and done["r0"][1]["type"] == "abort"
    for rid in ("r1", "r2", "r4", "r5"):
        assert done[rid] == plain[rid]
    sched.check_accounting()
    assert sched.allocator.free_pages + sched.cache.evictable_pages == \
        sched.allocator.total_pages


def test_logprobs_logit_bias_and_n_copies(tiny):
    """Logprobs of accepted tokens are the target's (as without speculation, within the
    extend-vs-decode rounding); logit_bias applies to every verified position; copies of one
    prompt (n > 1) decode alike."""
    prompt = _prompts()[3]
    params = greedy(20, logprobs=True, top_logprobs=2, logit_bias={"11": 2.5})
    want = drive(make_core(tiny).scheduler, [("a", prompt, params)])
    sched = make_core(tiny, **SPEC).scheduler
    for rid, ids, p in [("a", prompt, params), ("b", prompt, params), ("c", prompt, params)]:
        sched.add_request(rid, ids, p)
    lps: dict[str, list] = {"a": [], "b": [], "c": []}
    outs = {}
    while sched.has_work:
        for r in sched.step():
            lps[r.rid] += r.pending_lps
            r.pending_lps = []
            if r.finish:
                outs[r.rid] = list(r.output_ids)
    assert outs["a"] == outs["b"] == outs["c"] == want["a"][0]
    assert sched.stats()["spec_num_accepted_tokens"] > 0
    ref = make_core(tiny).scheduler
    ref.add_request("a", prompt, params)
    ref_lps = []
    while ref.has_work:
        for r in ref.step():
            ref_lps += r.pending_lps
            r.pending_lps = []
    for got in lps.values():
        assert len(got) == len(ref_lps) == 20
        for (lp, top), (rlp, rtop) in zip(got, ref_lps, strict=True):
            assert lp == pytest.approx(rlp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in rtop]
    sched.check_accounting()


def test_sampled_requests_run_and_seeds_repeat(tiny):
    params = {"max_new_tokens": 30, "temperature": 0.7, "top_k": 20, "ignore_eos": True,
              "seed": 123, "repetition_penalty": 1.1}
    outs = []
    for _ in range(2):
        sched = make_core(tiny, **SPEC).scheduler
        outs.append(drive(sched, [(f"s{i}", p, params) for i, p in enumerate(_prompts())],
                          check_every_step=True))
        assert all(len(ids) == 30 for ids, _ in outs[-1].values())
        assert sched.stats()["spec_verify_steps"] > 0
    assert outs[0] == outs[1]


@pytest.mark.slow  # a grammar compile process starts (about 45 s on two shared cores)
def test_constrained_requests_decode_without_speculation_with_a_note(tiny):
    regex = {"kind": "regex", "value": "[a-z]{4,9}( [a-z]{3,8}){2,4}\\."}
    params = {**greedy(40), "ignore_eos": False, "constraint": regex}
    want = drive(make_core(tiny).scheduler, [("g", _prompts()[1], params)])["g"]
    plan = make_plan(make_server_args(model_path=tiny[0], dtype="float32", **SPEC))[1]
    assert any("grammar constraint decode without speculation" in n for n in plan.notes)
    sched = make_core(tiny, **SPEC).scheduler
    got = drive(sched, [("g", _prompts()[1], params), ("p", _prompts()[3], greedy())])
    assert got["g"] == want
    s = sched.stats()
    assert s["spec_skipped_grammar"] == 1 and s["spec_num_accepted_tokens"] > 0
    sched.check_accounting()


# -- rejection sampling keeps the target distribution --------------------------------------------

def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """One position, V = 6, temperature 0.8, top-k 5 and a repetition penalty: the tokens
    Sampler.verify emits for a deterministic draft are distributed as the sampler's own
    processed distribution (chi-square far below the 0.999 quantile), whether the draft is
    likely, unlikely, or filtered out by top-k; the draft is accepted with probability p(x)."""
    torch.manual_seed(0)
    V, N = 6, 6000
    logits = torch.tensor([2.0, 1.5, 0.2, -0.5, 1.0, -3.0])
    params = SamplingParams.from_dict({"temperature": 0.8, "top_k": 5,
                                       "repetition_penalty": 1.3, "max_new_tokens": 4})
    sampler = Sampler(torch.device("cpu"), seed=1)
    states = [SamplingState(params, [1], [], V, torch.device("cpu")) for _ in range(N)]
    # the target's processed distribution, as the sampler computes it
    ref_logits = logits[None].clone()
    sampler._penalize(ref_logits, states[:1])
    p = sampler._filtered(ref_logits, states[:1], [False])[0]
    p = p / p.sum()
    toks, accepted, _ = sampler.verify(logits[None].repeat(N, 1), states, [draft] * N)
    counts = torch.bincount(torch.tensor(toks), minlength=V).double()
    assert counts[p == 0].sum() == 0
    chi2, dof = _chi2(counts, p.double())
    assert chi2 < {3: 16.3, 4: 18.5}[dof], (chi2, counts / N, p)
    rate = sum(accepted) / N
    assert abs(rate - float(p[draft])) < 4 * (float(p[draft]) * (1 - p[draft]) / N) ** 0.5 + 1e-9


def test_greedy_verification_is_exact_match():
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams.from_dict({"temperature": 0.0, "max_new_tokens": 4})
    states = [SamplingState(params, [1], [], 4, torch.device("cpu")) for _ in range(3)]
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0]] * 3)
    toks, ok, _ = sampler.verify(logits, states, [1, 2, None])
    assert toks == [1, 1, 1] and ok == [True, False, False]


# -- the counters on /metrics --------------------------------------------------------------------

def test_metrics_show_the_counters_while_speculation_is_on():
    m = ServerMetrics()
    on = m.render({"spec_num_drafts": 3, "spec_num_draft_tokens": 10,
                   "spec_num_accepted_tokens": 7}, True)
    assert "core_spec_decode_num_drafts_total 3" in on
    assert "core_spec_decode_num_draft_tokens_total 10" in on
    assert "core_spec_decode_num_accepted_tokens_total 7" in on
    assert "# TYPE core_spec_decode_num_drafts_total counter" in on
    assert "spec_decode" not in m.render({}, True)


def test_figures_pass_the_counters_to_the_server():
    from core.frontend.serving import _figures

    f = _figures({"spec_num_drafts": 1, "spec_num_draft_tokens": 4,
                  "spec_num_accepted_tokens": 2, "running": 0})
    assert (f["spec_num_drafts"], f["spec_num_accepted_tokens"]) == (1, 2)


# -- the default model (SmolLM2 GGUF) through the offline Engine ---------------------------------

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rewrite this text with every sentence on its own line:\n\n{TEXT}",
    "Here is some code:\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    "\nRewrite it with type hints (int) on every argument and return value.",
    "What is the capital of France?",  # open-ended: few drafts accepted, still identical
]


@pytest.fixture(scope="module")
def smol_pair():
    import core

    kw = {"dtype": "float32", "max_total_tokens": 8192, "quantization": "unquantized"}
    with core.Engine(**kw) as off, core.Engine(**kw, speculative_algorithm="ngram",
                                               chunked_prefill_size=32) as on:
        yield off, on


def _chat(engine, q):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                      add_special_tokens=False)


@pytest.mark.slow  # two SmolLM2 engines, 4 x 64 tokens each (minutes on two shared cores)
def test_default_model_greedy_identical_and_drafts_accepted(smol_pair):
    off, on = smol_pair
    ids = [_chat(off, q) for q in GROUNDED]
    params = {"max_new_tokens": 64, "temperature": 0}
    want = off.generate(input_ids=ids, sampling_params=params)
    got = on.generate(input_ids=ids, sampling_params=params)
    for w, g in zip(want, got, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["text"] == w["text"]
    s = on.stats()
    assert s["spec_num_accepted_tokens"] > 0 and s["spec_num_drafts"] > 0, s
    assert sum(g["meta_info"].get("spec_accepted_tokens", 0) for g in got) == \
        s["spec_num_accepted_tokens"]
    # the copying prompt accepts most of its drafts
    first = got[0]["meta_info"]
    assert first["spec_accepted_tokens"] > first["completion_tokens"] // 3, first
    assert "spec_num_drafts" not in off.stats()
    on.check_accounting()


@pytest.mark.slow
def test_default_model_abort_and_max_new_tokens_inside_a_run(smol_pair):
    off, on = smol_pair
    ids = _chat(off, GROUNDED[0])
    for n in (3, 17):
        params = {"max_new_tokens": n, "temperature": 0}
        want = off.generate(input_ids=ids, sampling_params=params)
        got = on.generate(input_ids=ids, sampling_params=params)
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["completion_tokens"] == n
    stream = on.generate(input_ids=ids, sampling_params={"max_new_tokens": 200,
                                                         "temperature": 0}, stream=True)
    first = next(stream)
    on.abort(first["rid"])
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    on.check_accounting()


# -- the conformance suite catches wrong proposers ----------------------------------------------

class _TooMany:
    def propose(self, requests):
        return [[1] * 10 for _ in requests]

    def observe(self, rid, drafted, accepted):
        pass

    def reset(self, rid):
        pass


class _Moody(_TooMany):
    def __init__(self):
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        return [[self.calls % 7] if r.max_tokens else [] for r in requests]


class _Fragile(_TooMany):
    def propose(self, requests):
        return [[r.tokens[-1]] for r in requests]  # IndexError on an empty request


def test_conformance_suite_fails_wrong_proposers():
    from conformance import spec_suite as suite

    with pytest.raises(AssertionError, match="drafts"):
        suite.check_bounds(_TooMany, 0)
    with pytest.raises(AssertionError, match="differently"):
        suite.check_determinism(_Moody, 0)
    with pytest.raises(IndexError):
        suite.check_short(_Fragile, 0)
    with pytest.raises(AssertionError, match="Proposer"):
        suite.check_protocol(object, 0)


def test_drafts_are_levelled_down_so_the_verify_rows_fit_the_largest_graph():
    """Where verify steps replay the decode graphs, a step's drafts are cut (the largest
    first) so that requests + drafts fit the largest bucket; nothing is cut where they fit,
    where verify steps do not replay graphs, or where the batch alone is past the graphs."""
    from types import SimpleNamespace

    from core.engine.scheduler.spec import Speculation

    def fit(ks, max_bs=16, verify_graphs=True, graphs=True):
        runner = SimpleNamespace(verify_graphs=verify_graphs, graph_runner=SimpleNamespace(
            max_bs=max_bs) if graphs else None)
        spec = SimpleNamespace(runner=runner, counters={"spec_graph_cut": 0})
        out = Speculation.fit_graphs(spec, list(ks))
        return out, spec.counters["spec_graph_cut"]

    assert fit([4, 4, 4]) == ([4, 4, 4], 0)  # 15 rows fit 16
    assert fit([4, 4, 4, 4]) == ([3, 3, 3, 3], 4)  # 20 -> 16 rows
    assert fit([4, 0, 4, 1, 4], max_bs=12) == ([2, 0, 2, 1, 2], 6)  # 7 drafts for 5 requests
    out, cut = fit([4] * 64, max_bs=160)  # session 24's c64 on an H100: 320 rows
    assert 64 + sum(out) == 160 and max(out) - min(out) <= 1 and cut == 256 - 96
    assert fit([4] * 20, max_bs=16) == ([4] * 20, 0)  # the batch itself is past the graphs
    assert fit([4] * 4, verify_graphs=False) == ([4] * 4, 0)
    assert fit([4] * 4, graphs=False) == ([4] * 4, 0)


def _q8_method() -> str:
    """The int8-activation GGUF method this CPU runs best (llama.cpp's arithmetic)."""
    from test_gguf_quant import cpu_features

    from plugins._kit.cbuild import ISA_FEATURES

    flags = cpu_features()
    for variant, method in (("avx512_vnni", "gguf_avx512_q8"), ("avx2", "gguf_avx2_q8")):
        if ISA_FEATURES[variant] <= flags:
            return method
    return "gguf_c_q8"


def test_default_model_greedy_identical_with_int8_activations():
    """With int8 activations a verify step must round exactly as decode steps do: through the
    prefill path its fp32 attention differed by ~1e-7, which int8 activation codes turned into
    flipped near-ties (these two bench prompts differed from speculation off at tokens 21 and
    45 before cpu_c ran verify rows as decode rows in fp32)."""
    import core

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_prompts import INPUT_GROUNDED

    prompts = [p["messages"] for p in INPUT_GROUNDED
               if p["name"] in ("quote_solar", "code_docstring")]
    kw = {"quantization": _q8_method(), "max_total_tokens": 4096}
    params = {"max_new_tokens": 80, "temperature": 0}
    with core.Engine(**kw) as off:
        tok = off.tokenizer
        ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in prompts]
        want = off.generate(input_ids=ids, sampling_params=params)
    with core.Engine(**kw, speculative_algorithm="ngram", speculative_governor="off") as on:
        got = on.generate(input_ids=ids, sampling_params=params)
        assert on.stats()["spec_num_accepted_tokens"] > 0
    for w, g in zip(want, got, strict=True):
        assert g["output_ids"] == w["output_ids"]
