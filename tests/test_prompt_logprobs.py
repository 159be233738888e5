"""Prompt logprobs and logit_bias in the scheduler, on a tiny random Llama (fp32, CPU).

Prompt logprobs are checked against Hugging Face transformers' own forward of the same model
(log-softmax of its logits at each prompt position), whole or prefilled in chunks, with a cached
prefix in the radix cache (which such a request must not reuse), and after retraction.
logit_bias is checked by what it does to greedy decoding and that logprobs stay the model's.
"""

from __future__ import annotations

from functools import partial

import hf_compare
import pytest
import torch
from hf_compare import check_prompt_logprobs, greedy
from model_fixtures import write_tiny_model

from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args

PROMPTS = [[(11 * i + 5 * j) % 240 + 3 for j in range(n)] for i, n in enumerate((37, 2, 1, 20))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama"))
    args, plan, _, registry = make_plan(make_server_args(model_path=path, dtype="float32"))
    return path, load_model(args, plan, registry)


@pytest.fixture(scope="module")
def hf_logprobs(tiny):
    """HF's log-softmax over each prompt position: {prompt index: [len, V]}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    return {i: hf_compare.hf_logprobs(model, p) for i, p in enumerate(PROMPTS)}


def make_core(tiny, **kw):
    path, loaded = tiny
    kw.setdefault("max_total_tokens", 2048)
    args, plan, spec, registry = make_plan(make_server_args(model_path=path, dtype="float32",
                                                            **kw))
    return build_engine_core(args, plan, spec, registry, loaded)


run = partial(hf_compare.run, max_steps=5000)


def params(k=2, max_new=4, **kw):
    return greedy(max_new, top=None, prompt_logprobs=k, **kw)


@pytest.mark.parametrize("scenario", [{}, {"chunked_prefill_size": 8},
                                      {"chunked_prefill_size": 8, "page_size": 4}])
def test_prompt_logprobs_equal_hf(tiny, hf_logprobs, scenario):
    core = make_core(tiny, **scenario)
    done = run(core.scheduler, [(f"p{i}", p, params()) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        check_prompt_logprobs(done[f"p{i}"], p, hf_logprobs[i], 2)
    core.scheduler.check_accounting()


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny, hf_logprobs):
    core = make_core(tiny, page_size=4)
    sched = core.scheduler
    run(sched, [("warm", PROMPTS[0], params(k=None))])  # caches PROMPTS[0]'s pages
    done = run(sched, [("again", PROMPTS[0], params(k=3)),
                       ("plain", PROMPTS[0], params(k=None))])
    check_prompt_logprobs(done["again"], PROMPTS[0], hf_logprobs[0], 3)
    assert done["again"].cached_tokens == 0  # it took nothing from the cache
    assert done["plain"].cached_tokens > 0  # the one without prompt logprobs did
    assert done["again"].output_ids == done["plain"].output_ids


def test_prompt_logprobs_survive_retraction(tiny, hf_logprobs):
    core = make_core(tiny, page_size=1, max_total_tokens=100, schedule_conservativeness=0.05)
    reqs = [(f"p{i}-{c}", p, params(max_new=24)) for c in range(3)
            for i, p in enumerate(PROMPTS)]
    done = run(core.scheduler, reqs)
    assert core.scheduler.counters["retractions"] > 0, "meant to force retraction"
    for rid, req in done.items():
        i = int(rid[1])
        check_prompt_logprobs(req, PROMPTS[i], hf_logprobs[i], 2)
    core.scheduler.check_accounting()


def test_logit_bias_steers_greedy_decoding(tiny):
    core = make_core(tiny)
    sched = core.scheduler
    base = run(sched, [("base", PROMPTS[0], {"max_new_tokens": 6, "temperature": 0.0,
                                            "ignore_eos": True, "logprobs": True})])["base"]
    first = base.output_ids[0]
    favoured = (first + 17) % 200 + 3
    done = run(sched, [
        ("up", PROMPTS[0], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                            "logit_bias": {favoured: 100.0}, "logprobs": True}),
        ("down", PROMPTS[0], {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                              "logit_bias": {str(first): -100.0}}),
        ("hot", PROMPTS[0], {"max_new_tokens": 6, "temperature": 1.0, "seed": 5,
                             "ignore_eos": True, "logit_bias": {favoured: 100.0}})])
    assert done["up"].output_ids == [favoured] * 6
    assert done["hot"].output_ids == [favoured] * 6  # sampling sees the bias too
    assert done["down"].output_ids[0] != first
    # logprobs are the model's own distribution (vLLM's default), not the biased one: the
    # favoured token's is below the unbiased argmax's (with the bias in, it would be ~0)
    up_lp, base_lp = done["up"].pending_lps[0][0], base.pending_lps[0][0]
    assert up_lp < base_lp < 0


def test_bad_logit_bias_is_refused(tiny):
    core = make_core(tiny)
    for bias, msg in (({5: 101.0}, "in [-100, 100]"), ({-1: 1.0}, "token ids"),
                      ({10**9: 1.0}, "outside the vocabulary"), ({"x": 1.0}, "token ids")):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            core.scheduler.add_request("bad", PROMPTS[0], {"logit_bias": bias})
