"""The offline Engine end to end: SmolLM2 against HF transformers, sampling, the process model.

The HF reference (tests/hf_reference.py) runs `generate(do_sample=False)` per prompt on the same
GGUF weights, once per module.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from hf_reference import hf_gguf_model
from model_fixtures import write_tiny_model

import core
from core.frontend.offline import EngineError

MAX_NEW = 64
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip, one per line.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you today?' into Spanish and French.",
    "You are helping a student. Summarize the water cycle: evaporation, condensation, "
    "precipitation and collection, with one example of each stage from daily life.",
    "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
    "kiwi, lemon, mango, nectarine, orange, papaya. Which of them are citrus fruits, and which "
    "grow on trees? Answer briefly.",
]


# HF transformers dequantizes the GGUF file: so does `--quantization unquantized`, which these
# token-for-token comparisons run (the default CPU path keeps the blocks and quantizes the
# activations to int8 like llama.cpp; tests/test_gguf_quant.py holds that path to HF).
DEQUANTIZED = {"quantization": "unquantized"}


@pytest.fixture(scope="module")
def smol():
    with core.Engine(dtype="float32", max_total_tokens=8192, **DEQUANTIZED) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompt_ids(smol):
    tok = smol.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                       add_special_tokens=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(smol, prompt_ids):
    model = hf_gguf_model(smol.args.model_path)
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                               do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    assert sum(len(o) for o in outs) > 4 * MAX_NEW, "the prompts should give long answers"
    return outs


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


def test_greedy_matches_hf_transformers(smol, prompt_ids, hf_greedy):
    outs = smol.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy, strict=True)):
        assert out["output_ids"] == ref, f"prompt {i} differs from HF"
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids[i])
        assert meta["completion_tokens"] == len(ref)
        reason = meta["finish_reason"]
        assert reason["type"] == ("length" if len(ref) == MAX_NEW else "stop")
        assert out["text"] == smol.tokenizer.decode(out["output_ids"])
    smol.check_accounting()


@pytest.mark.slow  # ~2 min on a loaded 2-core CPU (a second engine; retraction on the tiny
# model stays in CI: tests/test_scheduler.py)
def test_small_pool_pages_and_chunks_match_hf(prompt_ids, hf_greedy):
    # 8 requests of 32-85 prompt tokens + 64 new in a 320-token pool: decode must retract.
    with core.Engine(dtype="float32", max_total_tokens=320, page_size=16,
                     chunked_prefill_size=16, schedule_conservativeness=0.05,
                     **DEQUANTIZED) as engine:
        outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == hf_greedy
        stats = engine.stats()
        assert stats["retractions"] > 0 and stats["page_size"] == 16
        engine.check_accounting()


def test_prefix_cache_reports_cached_tokens(smol, prompt_ids, hf_greedy):
    short = {"max_new_tokens": 8, "temperature": 0}
    first = smol.generate(input_ids=prompt_ids[6], sampling_params=short)
    again = smol.generate(input_ids=prompt_ids[6], sampling_params=short)
    assert again["meta_info"]["cached_tokens"] >= len(prompt_ids[6]) - 1
    assert first["output_ids"] == again["output_ids"] == hf_greedy[6][:8]


def test_streaming_concatenates_to_the_full_text(smol, prompt_ids, hf_greedy):
    chunks = list(smol.generate(input_ids=prompt_ids[2], sampling_params=GREEDY, stream=True))
    assert len(chunks) > 1
    assert sum((c["token_ids"] for c in chunks), []) == hf_greedy[2]
    assert "".join(c["text"] for c in chunks) == smol.tokenizer.decode(hf_greedy[2])
    assert [c["finish_reason"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_stop_string_trims_the_text(smol, prompt_ids, hf_greedy):
    full_ids = hf_greedy[4]
    full_text = smol.tokenizer.decode(full_ids)
    words = full_text.split()
    assert len(words) > 6
    stop = " " + words[5]
    cut = full_text.find(stop)
    out = smol.generate(input_ids=prompt_ids[4], sampling_params={**GREEDY, "stop": [stop]})
    assert out["text"] == full_text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == full_ids[:len(out["output_ids"])]
    streamed = smol.generate(input_ids=prompt_ids[4], stream=True,
                             sampling_params={**GREEDY, "stop": stop})
    assert "".join(c["text"] for c in streamed) == full_text[:cut]


def test_seeds_n_and_logprobs(smol, prompt_ids):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 7}
    a = smol.generate(input_ids=prompt_ids[1], sampling_params=sp)
    # same seed alone and inside a batch with other sampled requests: same tokens
    batch = smol.generate(input_ids=[prompt_ids[1], prompt_ids[2], prompt_ids[1]],
                          sampling_params=[sp, {**sp, "seed": None}, sp])
    assert a["output_ids"] == batch[0]["output_ids"] == batch[2]["output_ids"]
    others = [smol.generate(input_ids=prompt_ids[1], sampling_params={**sp, "seed": s})
              for s in (8, 9)]
    assert any(o["output_ids"] != a["output_ids"] for o in others)
    many = smol.generate(input_ids=prompt_ids[1], sampling_params={**sp, "n": 3})
    assert len(many) == 3 and many[0]["output_ids"] == a["output_ids"]  # copy i: seed + i
    assert many[1]["output_ids"] == others[0]["output_ids"]
    lp = smol.generate(input_ids=prompt_ids[3], sampling_params={
        "max_new_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    meta = lp["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(lp["output_ids"]) == 8
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    for (chosen, tok), top, out_tok in zip(meta["output_token_logprobs"],
                                           meta["output_top_logprobs"], lp["output_ids"],
                                           strict=True):
        assert tok == out_tok and top[0][1] == tok  # greedy: the chosen token is the top one
        assert chosen == pytest.approx(top[0][0]) and chosen <= 0
    smol.check_accounting()


def test_bad_requests_are_rejected_with_the_reason(smol):
    with pytest.raises(ValueError, match="top_p"):
        smol.generate("hello", {"top_p": 0})
    with pytest.raises(ValueError, match="frequency_penalty"):
        smol.generate("hello", {"frequency_penalty": float("nan")})
    with pytest.raises(ValueError, match=r"exceeds the context length 8192"):
        smol.generate("hello", {"max_new_tokens": 9000})
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        smol.generate()
    assert smol.health()


# -- the process model, on a tiny random model ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny-engine") / "llama"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_close_leaves_no_process(tiny_path):
    engine = core.Engine(tiny_path, max_total_tokens=512)
    pid = engine.info.pid
    assert _alive(pid) and engine.health()
    assert engine.client.process in mp.active_children()
    out = engine.generate("abc", {"max_new_tokens": 4, "temperature": 0})
    assert len(out["output_ids"]) == 4
    engine.close()
    assert not engine.health()
    assert engine.client.process not in mp.active_children()
    assert not _alive(pid)
    engine.close()  # idempotent
    with pytest.raises(EngineError, match="not running"):
        engine.generate("abc", {"max_new_tokens": 4})


def test_worker_death_is_detected(tiny_path):
    with core.Engine(tiny_path, max_total_tokens=512) as engine:
        rid = engine.client.submit("abc", {"max_new_tokens": 200, "temperature": 0,
                                           "ignore_eos": True})
        os.kill(engine.info.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="exited|failed"):
            for _ in engine.client.stream(rid, timeout=60):
                pass
        deadline = time.time() + 30
        while engine.health() and time.time() < deadline:
            time.sleep(0.1)
        assert not engine.health()
        with pytest.raises(EngineError):
            engine.generate("abc", {"max_new_tokens": 2})
    assert engine.client.process not in mp.active_children()
    assert not _alive(engine.info.pid)


def test_abort_and_async_stream(tiny_path):
    with core.Engine(tiny_path, max_total_tokens=512) as engine:
        client = engine.client
        rid = client.submit("hello", {"max_new_tokens": 200, "temperature": 0,
                                      "ignore_eos": True})
        chunks = []
        for chunk in client.stream(rid, timeout=60):
            chunks.append(chunk)
            if len(chunks) == 2:
                client.abort(rid)
        assert chunks[-1].finish.type == "abort"
        assert chunks[-1].prompt_tokens and sum(len(c.token_ids) for c in chunks) < 200

        sync = engine.generate("hello", {"max_new_tokens": 12, "temperature": 0})

        async def collect():
            return [c async for c in client.stream_async("hello", {"max_new_tokens": 12,
                                                                    "temperature": 0})]

        achunks = asyncio.run(collect())
        assert [t for c in achunks for t in c.token_ids] == sync["output_ids"]
        assert "".join(c.text for c in achunks) == sync["text"]
        # a stream dropped early aborts its request
        gen = engine.generate("hello", {"max_new_tokens": 200, "temperature": 0,
                                        "ignore_eos": True}, stream=True)
        next(gen)
        gen.close()
        stats = engine.stats()  # answered after the abort: the pipe keeps order
        assert stats["aborted"] == 2 and stats["running"] == 0
        engine.check_accounting()
