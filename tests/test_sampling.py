"""Sampling parameters (validation) and the batched sampler."""

import math

import pytest
import torch

from core.engine.sampling import Sampler, SamplingParams, SamplingState

V = 50
CPU = torch.device("cpu")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.inf), ("top_k", 0), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 2.0), ("repetition_penalty", 0.0),
    ("frequency_penalty", 3.0), ("presence_penalty", -2.5), ("max_new_tokens", 0),
    ("max_new_tokens", True), ("max_new_tokens", "10"), ("n", 0), ("seed", -(2**63) - 1),
    ("seed", 2**63),
    ("top_logprobs", 50), ("logprobs", 1), ("ignore_eos", "yes"), ("stop", [""]),
    ("stop", [3]), ("stop_token_ids", [-1]), ("stop_token_ids", "2"),
    ("skip_special_tokens", None),
])
def test_invalid_params_are_rejected_by_name(field, value):
    d = {field: value}
    if field == "skip_special_tokens":
        p = SamplingParams(skip_special_tokens=value)
        with pytest.raises(ValueError, match=field):
            p.validate()
        return
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(d)


def test_min_new_tokens_cannot_exceed_max():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5})


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_stop_string_becomes_a_list_and_valid_params_pass():
    p = SamplingParams.from_dict({"stop": "\n", "temperature": 0, "top_k": 5, "seed": 3})
    assert p.stop == ["\n"] and p.greedy
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_stop_token_ids_outside_vocab():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[99]).check_vocab(50)


def _states(params_list, prompt=(1, 2, 3)):
    return [SamplingState(p, list(prompt), [0], V, CPU) for p in params_list]


def _logits(B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def test_greedy_is_argmax():
    logits = _logits(3)
    out = Sampler(CPU).sample(logits.clone(), _states([SamplingParams(temperature=0)] * 3))
    assert out.tokens == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_extra):
        s = Sampler(CPU, seed=0)
        st = _states([p])[0]
        others = _states([SamplingParams(temperature=1.0)] * batch_extra)
        toks = []
        for step in range(20):
            logits = _logits(1 + batch_extra, seed=step)
            logits[0] = _logits(1, seed=100 + step)[0]
            toks.append(s.sample(logits, [st] + others).tokens[0])
        return toks

    alone, together = run(0), run(3)
    assert alone == together
    other_seed = SamplingParams(temperature=1.0, seed=99)
    s = Sampler(CPU)
    st = _states([other_seed])[0]
    toks = [s.sample(_logits(1, seed=100 + i), [st]).tokens[0] for i in range(20)]
    assert toks != alone


def test_negative_seeds_are_seeds():
    """OpenAI takes any integer as a seed (vLLM the signed 64-bit range): a negative seed is
    valid, repeatable, and a different stream from its absolute value."""
    def draw(seed):
        st = _states([SamplingParams(temperature=1.0, seed=seed)])[0]
        s = Sampler(CPU)
        return [s.sample(_logits(1, seed=100 + i), [st]).tokens[0] for i in range(20)]

    for seed in (-1, -(2**63), 2**63 - 1):
        SamplingParams(temperature=1.0, seed=seed).validate()
    assert draw(-7) == draw(-7)
    assert draw(-7) != draw(7)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(2)
    s = Sampler(CPU)
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        for _ in range(5):
            out = s.sample(logits.clone(), _states([p, p]))
            assert out.tokens == logits.argmax(-1).tolist()


def test_top_k_restricts_the_draw():
    logits = _logits(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    s = Sampler(CPU, seed=5)
    st = _states([SamplingParams(top_k=3, temperature=5.0)])
    drawn = {s.sample(logits.clone(), st).tokens[0] for _ in range(200)}
    assert drawn <= top3 and len(drawn) > 1


def test_sampling_follows_the_distribution():
    logits = torch.full((1, V), -30.0)
    logits[0, 7] = math.log(0.75)
    logits[0, 9] = math.log(0.25)
    s = Sampler(CPU, seed=1)
    st = _states([SamplingParams(temperature=1.0)])
    draws = [s.sample(logits.clone(), st).tokens[0] for _ in range(2000)]
    assert set(draws) == {7, 9}
    assert 0.7 < draws.count(7) / 2000 < 0.8


def test_repetition_penalty_demotes_prompt_tokens():
    logits = torch.zeros(1, V)
    logits[0, 2] = 1.0  # in the prompt
    logits[0, 10] = 0.8
    s = Sampler(CPU)
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert s.sample(logits.clone(), _states([p])).tokens == [10]
    assert s.sample(logits.clone(), _states([SamplingParams(temperature=0)])).tokens == [2]


def test_frequency_and_presence_penalties_count_outputs():
    s = Sampler(CPU)
    p = SamplingParams(temperature=0, frequency_penalty=0.5)
    st = _states([p])
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 5] = 0.8
    assert s.sample(logits.clone(), st).tokens == [4]  # no penalty yet, 4 counted once
    assert s.sample(logits.clone(), st).tokens == [5]  # 1.0 - 0.5 < 0.8
    pp = _states([SamplingParams(temperature=0, presence_penalty=0.1)])
    assert s.sample(logits.clone(), pp).tokens == [4]
    assert s.sample(logits.clone(), pp).tokens == [4]  # 0.9 still beats 0.8


def test_min_new_tokens_masks_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0  # token 0 is the stop id of _states
    s = Sampler(CPU)
    st = _states([SamplingParams(temperature=0, min_new_tokens=2, max_new_tokens=5)])
    assert s.sample(logits.clone(), st).tokens[0] != 0
    assert s.sample(logits.clone(), st).tokens[0] != 0
    assert s.sample(logits.clone(), st).tokens[0] == 0


def test_logprobs_shape_and_values():
    logits = _logits(3)
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=4),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=0)]
    out = Sampler(CPU).sample(logits.clone(), _states(params))
    ref = torch.log_softmax(logits, -1)
    chosen, top = out.logprobs[0]
    assert len(top) == 4
    assert top[0][0] == out.tokens[0]
    assert chosen == pytest.approx(ref[0, out.tokens[0]].item(), abs=1e-5)
    assert [t for t, _ in top] == ref[0].topk(4).indices.tolist()
    assert out.logprobs[1] is None
    assert out.logprobs[2][1] == []
