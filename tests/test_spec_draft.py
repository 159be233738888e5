"""Speculative decoding with a draft model (issue 33: the `standalone` proposer, vLLM's
`draft_model`): the flags and the plan (the draft resolved as its own plan, refusals with
reasons), the engine's draft runner and its own paged KV pool, greedy outputs identical to
speculation off with the target itself as draft (every draft accepted), a different random
model (none accepted) and a perturbed copy of the target (some accepted), with chunked
prefill, paging, retraction and aborts, both pools' accounting after every step, and the
/metrics counters."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from model_fixtures import write_tiny_model
from test_spec_decode import _prompts, greedy  # the same prompts and greedy params

from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args
from core.plan.plan import Plan, ResolveError
from core.server.metrics import ServerMetrics

MAX_NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Paths of the target, a different random model with the same vocabulary (one layer,
    another seed), and the target's weights with noise (partial acceptance); the target
    loaded once."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("draft")
    target = str(write_tiny_model("llama", root / "target"))
    other = str(write_tiny_model("llama", root / "other", seed=1, num_hidden_layers=1))
    noisy = root / "noisy"
    shutil.copytree(target, noisy)
    weights = load_file(str(noisy / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    weights = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2
               else v for k, v in weights.items()}
    save_file(weights, str(noisy / "model.safetensors"), metadata={"format": "pt"})
    args, plan, _, registry = make_plan(make_server_args(model_path=target, dtype="float32"))
    return {"target": target, "self": target, "other": other, "noisy": str(noisy),
            "loaded": load_model(args, plan, registry)}


def make_core(models, draft: str | None = "self", **kw):
    kw.setdefault("max_total_tokens", 2048)
    if draft is not None:
        kw.update(speculative_algorithm="standalone",
                  speculative_draft_model_path=models[draft])
        kw.setdefault("speculative_governor", "off")  # counted drafts: no timing-driven cuts
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=models["target"], dtype="float32", **kw))
    return build_engine_core(args, plan, spec, registry, models["loaded"])


def _requests():
    return [(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(_prompts())]


def drive(sched, requests, check_every_step: bool = True):
    for rid, ids, params in requests:
        sched.add_request(rid, ids, params)
    out, steps = {}, 0
    while sched.has_work:
        for r in sched.step():
            if r.finish is not None:
                out[r.rid] = (list(r.output_ids), r.finish)
        if check_every_step:
            sched.check_accounting()  # the target's pages and the draft's
        steps += 1
        assert steps < 5000
    return out


def _draft_idle(sched) -> None:
    """Nothing held in the draft's pool: every page free, every row back."""
    d = sched.spec.draft
    assert d.held == {}
    assert d.allocator.free_pages == d.allocator.total_pages
    assert d.req_to_token.free_rows == d.req_to_token.max_reqs


@pytest.fixture(scope="module")
def plain(models):
    return drive(make_core(models, None).scheduler, _requests(), check_every_step=False)


# -- flags and the plan --------------------------------------------------------------------------

def test_plan_names_the_draft_and_survives_json(models):
    plan = make_plan(make_server_args(
        model_path=models["target"], dtype="float32", speculative_algorithm="STANDALONE",
        speculative_draft_model_path=models["other"], speculative_num_draft_tokens=3))[1]
    assert plan.spec_proposer == "standalone" and plan.spec_draft_tokens == 3
    d = plan.spec_draft
    assert (d.model_impl, d.dtype, d.quant_method, d.spec_draft) == ("llama", "float32",
                                                                     "unquantized", None)
    note = next(n for n in plan.notes if n.startswith("draft model "))
    assert models["other"] in note and "1 layers" in note and "dtype float32" in note
    assert "quant unquantized" in note and "3 drafts greedily" in note
    # the draft's own attention backend; the target keeps its own
    own = make_plan(make_server_args(
        model_path=models["target"], dtype="float32", speculative_algorithm="standalone",
        speculative_draft_model_path=models["other"],
        speculative_draft_attention_backend="torch_native"))[1]
    assert own.spec_draft.prefill_attention == own.spec_draft.decode_attention == "torch_native"
    assert (own.prefill_attention, own.decode_attention) == (d.prefill_attention,
                                                             d.decode_attention)
    with pytest.raises(ResolveError, match="cannot run here"):
        make_plan(make_server_args(
            model_path=models["target"], dtype="float32", speculative_algorithm="standalone",
            speculative_draft_model_path=models["other"],
            speculative_draft_attention_backend="no-such-backend"))
    # the worker gets the plan as JSON (core serve's path)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    from core.plan.resolver import explain

    assert "draft model        llama, float32, unquantized" in explain(plan)
    # vLLM's form maps onto the same flags
    v = make_server_args(speculative_config=json.dumps(
        {"method": "draft_model", "model": models["other"], "num_speculative_tokens": 2}))
    assert (v.speculative_algorithm, v.speculative_draft_model_path,
            v.speculative_num_draft_tokens) == ("draft_model", models["other"], 2)
    vplan = make_plan(v.replace(model_path=models["target"], dtype="float32"))[1]
    assert vplan.spec_proposer == "standalone" and vplan.spec_draft is not None


def test_core_resolve_shows_the_draft(models, capsys):
    from core.cli import main

    assert main(["resolve", "--model-path", models["target"], "--speculative-algorithm",
                 "standalone", "--speculative-draft-model-path", models["other"]]) in (0, None)
    out = capsys.readouterr().out
    assert "speculative        standalone, 4 draft tokens" in out
    assert "draft model        llama" in out and f"draft model {models['other']}" in out


def test_refusals_with_reasons(models, tmp_path):
    t = {"model_path": models["target"], "dtype": "float32"}
    with pytest.raises(ResolveError, match="does not fit") as e:
        make_plan(make_server_args(**t, speculative_algorithm="standalone"))
    assert "needs a draft model (--speculative-draft-model-path)" in str(e.value)
    with pytest.raises(ResolveError, match="runs no draft model"):
        make_plan(make_server_args(**t, speculative_algorithm="ngram",
                                   speculative_draft_model_path=models["other"]))
    with pytest.raises(ResolveError, match="tensor parallelism"):
        make_plan(make_server_args(**t, speculative_algorithm="standalone",
                                   speculative_draft_model_path=models["other"], tp_size=2))
    wide = str(write_tiny_model("llama", tmp_path / "wide", num_hidden_layers=1,
                                vocab_size=300))
    with pytest.raises(ResolveError, match="the draft's vocabulary has 300 ids, the target's "
                                           "260") as e:
        make_plan(make_server_args(**t, speculative_algorithm="standalone",
                                   speculative_draft_model_path=wide))
    assert "share the target's tokenizer" in str(e.value)
    with pytest.raises(ResolveError, match="model path not found"):
        make_plan(make_server_args(**t, speculative_algorithm="standalone",
                                   speculative_draft_model_path=str(tmp_path / "none")))
    with pytest.raises(ResolveError, match="the draft model .* cannot run here"):
        make_plan(make_server_args(**t, speculative_algorithm="standalone",
                                   speculative_draft_model_path=models["other"],
                                   speculative_draft_model_quantization="no-such-method"))
    for kw, msg in (({"speculative_draft_model_path": models["other"]},
                     "needs --speculative-algorithm"),
                    ({"speculative_algorithm": "standalone",
                      "speculative_draft_load_format": "gguf"},
                     "needs --speculative-draft-model-path"),
                    ({"speculative_algorithm": "standalone",
                      "speculative_draft_model_path": models["other"],
                      "speculative_draft_load_format": "onnx"}, "is not one of"),
                    ({"speculative_config": '{"method": "draft_model", "model": 3}'},
                     "model must be a string"),
                    ({"speculative_algorithm": "standalone",
                      "speculative_draft_attention_backend": "torch_native"},
                     "needs --speculative-draft-model-path"),
                    ({"speculative_algorithm": "standalone",
                      "speculative_draft_model_path": models["other"],
                      "speculative_draft_model_revision": "main"}, "local path")):
        with pytest.raises(ValueError, match=msg):
            make_server_args(**t, **kw)


def test_a_draft_with_another_tokenizer_is_refused_at_load(models, tmp_path):
    """Same vocabulary size, different token ids: the plan cannot see it, the load does."""
    path = tmp_path / "swapped"
    shutil.copytree(models["other"], path)
    tj = json.loads((path / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=models["target"], dtype="float32", max_total_tokens=512,
        speculative_algorithm="standalone", speculative_draft_model_path=str(path)))
    with pytest.raises(ValueError, match="does not share the target's tokenizer: 2 of the "
                                         "target's 260 tokens differ"):
        build_engine_core(args, plan, spec, registry, models["loaded"])


# -- the draft runner ----------------------------------------------------------------------------

def test_draft_runner_chunks_truncates_and_drops(models):
    """A long catch-up in chunks gives the same token as in one forward; truncate gives pages
    back; a pool too small for a request drops it (None), never raises."""
    sched = make_core(models, "other", max_total_tokens=256, chunked_prefill_size=16).scheduler
    d = sched.spec.draft
    prompt = _prompts()[5]  # 55 tokens: 4 chunks of 16
    d.max_extend = 1000
    whole = d.forward(["a"], [prompt])
    d.max_extend = 16
    chunked = d.forward(["b"], [prompt])
    assert whole == chunked and whole[0] is not None
    assert d.cached("a") == tuple(prompt)
    both = d.forward(["a", "b"], [[whole[0]], [whole[0]]])
    assert both[0] == both[1]
    d.truncate("a", 10)
    assert d.cached("a") == tuple(prompt[:10])
    d.check_accounting({"a", "b"})
    assert d.forward(["a"], [prompt[10:] + [whole[0]]]) == [both[0]]
    d.release("a"), d.release("b"), d.release("never")
    _draft_idle(sched)
    free = d.allocator.free_pages
    assert d.forward(["huge"], [[5] * (free * d.page_size + 1)]) == [None]
    assert d.dropped == 1
    _draft_idle(sched)
    with pytest.raises(ValueError, match="at least one new token"):
        d.forward(["x"], [[]])


# -- greedy outputs identical to speculation off -------------------------------------------------

SCENARIOS = {  # (draft, flags)
    "self-chunk16": ("self", {"chunked_prefill_size": 16}),
    "other-page4-chunk8": ("other", {"page_size": 4, "chunked_prefill_size": 8}),
    "noisy-chunk16-drafts6": ("noisy", {"chunked_prefill_size": 16,
                                        "speculative_num_draft_tokens": 6}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_outputs_identical_with_a_draft_model(models, plain, name):
    draft, flags = SCENARIOS[name]
    core = make_core(models, draft, **flags)
    sched = core.scheduler
    got = drive(sched, _requests())
    assert got == plain
    s = sched.stats()
    drafted, accepted = s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]
    assert s["spec_num_drafts"] > 0 and drafted >= s["spec_num_drafts"]
    assert s["spec_draft_forwards"] >= s["spec_verify_steps"]  # one draft forward at least
    if draft == "self":  # the target drafting for itself: every draft accepted
        assert accepted == drafted
        fc = sched.runner.forward_count
        assert fc.get("verify", 0) + fc["decode"] < MAX_NEW * len(plain) // 2
    elif draft == "other":
        assert accepted < drafted // 10, s
    else:
        assert 0 < accepted < drafted, s
    assert any(n.startswith("standalone proposer") for n in core.info.notes)
    assert any(n.startswith("draft model KV cache") for n in core.info.notes)
    sched.check_accounting()
    _draft_idle(sched)
    # the /metrics counters are the scheduler's
    text = ServerMetrics().render(s, True)
    assert f"core_spec_decode_num_draft_tokens_total {drafted}" in text
    assert f"core_spec_decode_num_accepted_tokens_total {accepted}" in text
    assert f"core_spec_decode_num_drafts_total {s['spec_num_drafts']}" in text


def test_an_fp8_copy_of_the_target_as_draft(models, plain):
    """The draft's own quantization (--speculative-draft-model-quantization): the target's
    weights quantized to fp8 at load draft for it; the plan says so, most drafts are
    accepted and the outputs are the target's."""
    core = make_core(models, "self", speculative_draft_model_quantization="fp8")
    d = make_plan(make_server_args(
        model_path=models["target"], dtype="float32", speculative_algorithm="standalone",
        speculative_draft_model_path=models["self"],
        speculative_draft_model_quantization="fp8"))[1].spec_draft
    assert (d.quant_method, d.quant_format) == ("fp8", "fp8_channel")
    sched = core.scheduler
    assert drive(sched, _requests(), check_every_step=False) == plain
    s = sched.stats()
    assert s["spec_num_draft_tokens"] // 2 < s["spec_num_accepted_tokens"], s
    sched.check_accounting()
    _draft_idle(sched)


def test_sampled_requests_with_a_draft_repeat_with_their_seeds(models):
    """temperature > 0: the drafts go through the engine's rejection sampling; a seeded
    request gives the same tokens when sent again."""
    params = {"max_new_tokens": 16, "temperature": 0.8, "top_k": 20, "ignore_eos": True,
              "seed": 7}
    sched = make_core(models, "self").scheduler
    outs = [drive(sched, [(f"{run}{i}", p, params) for i, p in enumerate(_prompts()[:3])],
                  check_every_step=False) for run in "ab"]
    assert sched.stats()["spec_verify_steps"] > 0
    _draft_idle(sched)
    assert [v for _, v in sorted(outs[0].items())] == [v for _, v in sorted(outs[1].items())]
    assert all(len(ids) == 16 for ids, _ in outs[0].values())


@pytest.mark.slow  # two Gemma 3 engines (about 10 s on two shared cores: kept out of the quick
# suite's budget)
def test_a_hybrid_kv_target_with_itself_as_draft(tmp_path):
    """Gemma 3 (alternating sliding-window layers): the target's KV pool is hybrid (a windowed
    group), the draft's is one plain pool (its windows masked); outputs identical, every
    draft accepted, both pools consistent after every step."""
    path = str(write_tiny_model("gemma3", tmp_path / "gemma3"))
    reqs = [(f"g{i}", p, greedy(16)) for i, p in enumerate(_prompts()[1:4])]
    outs, cores = [], []
    for kw in ({}, {"speculative_algorithm": "standalone",
                    "speculative_draft_model_path": path}):
        args, plan, spec, registry = make_plan(make_server_args(
            model_path=path, dtype="float32", max_total_tokens=1024, chunked_prefill_size=16,
            **kw))
        cores.append(build_engine_core(args, plan, spec, registry))
        outs.append(drive(cores[-1].scheduler, reqs))
    assert outs[0] == outs[1]
    sched = cores[1].scheduler
    assert sched.pages.windows  # the target's pool is hybrid
    s = sched.stats()
    assert s["spec_num_draft_tokens"] == s["spec_num_accepted_tokens"] > 0
    _draft_idle(sched)


def test_retraction_releases_the_draft_and_keeps_outputs(models):
    reqs = [(rid, ids, greedy(40)) for rid, ids, _ in _requests()]
    want = drive(make_core(models, None).scheduler, reqs, check_every_step=False)
    sched = make_core(models, "noisy", max_total_tokens=200).scheduler
    got = drive(sched, reqs)
    assert got == want
    assert sched.stats()["retractions"] > 0
    _draft_idle(sched)


def test_abort_mid_draft_leaves_both_pools_consistent(models, plain):
    """Aborts while the draft holds unverified drafts: both pools stay consistent, the
    other requests' outputs are unchanged (their stale drafts are cut at the next step)."""
    sched = make_core(models, "self", chunked_prefill_size=16).scheduler
    for rid, ids, p in _requests():
        sched.add_request(rid, ids, p)
    d, done = sched.spec.draft, {}
    while sched.stats()["spec_verify_steps"] < 2:
        for r in sched.step():
            if r.finish:
                done[r.rid] = (list(r.output_ids), r.finish)
    # mid-draft: the draft has run ahead (K/V of drafts never verified, as when the target's
    # pool cannot take a verify step and the step decodes plainly)
    before = {rid: len(d.cached(rid)) for rid in d.held}
    assert sched.spec.propose(list(sched.running)) is not None
    assert any(len(d.cached(rid)) > n for rid, n in before.items())
    gone = sorted(d.held)[:2]  # two requests with draft K/V now
    assert len(gone) == 2
    assert all(sched.abort(rid) for rid in gone)
    assert not set(gone) & set(d.held)
    sched.check_accounting()
    while sched.has_work:
        for r in sched.step():
            if r.finish:
                done[r.rid] = (list(r.output_ids), r.finish)
        sched.check_accounting()
    assert all(done[rid][1]["type"] == "abort" for rid in gone)
    for rid in set(plain) - set(gone):
        assert done[rid] == plain[rid]
    assert sched.allocator.free_pages + sched.cache.evictable_pages == \
        sched.allocator.total_pages
    _draft_idle(sched)


def test_the_draft_rolls_back_to_the_accepted_tokens(models):
    """After each verify step the draft holds no rejected draft: what it caches of a request
    is a prefix of the request's tokens (the last one and the bonus are fed next step)."""
    sched = make_core(models, "noisy").scheduler
    for rid, ids, p in _requests():
        sched.add_request(rid, ids, p)
    d, checked = sched.spec.draft, 0
    while sched.has_work:
        sched.step()
        for r in sched.running:
            held = d.cached(r.rid)
            assert list(held) == r.all_ids[:len(held)], r.rid
            checked += bool(held)
    assert checked > 20


# -- the conformance suite catches a draft-model proposer that leaks -----------------------------

def test_conformance_catches_a_proposer_that_keeps_the_draft():
    from conformance import spec_suite as suite
    from plugins.spec.draft_model.proposer import DraftModelProposer

    class Leaky(DraftModelProposer):
        def reset(self, rid):
            pass

    suite.check_draft_release(suite.Builder(DraftModelProposer, True), 0)
    with pytest.raises(AssertionError, match="still holds"):
        suite.check_draft_release(suite.Builder(Leaky, True), 0)
    with pytest.raises(ValueError, match="needs the engine's draft model"):
        DraftModelProposer(suite.CONFIG)


# -- the default model (SmolLM2 GGUF) drafting for itself, through the offline Engine ------------

@pytest.mark.slow  # two SmolLM2 engines, one with a second copy as its draft (a minute or more)
def test_default_model_with_itself_as_draft():
    import core

    kw = {"dtype": "float32", "max_total_tokens": 4096, "quantization": "unquantized"}
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog.",
               "What is the capital of France?", "Count from one to ten in words."]
    params = {"max_new_tokens": 32, "temperature": 0}
    with core.Engine(**kw) as off:
        tok = off.tokenizer
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                          add_special_tokens=False) for q in prompts]
        want = off.generate(input_ids=ids, sampling_params=params)
        path = off.server_args.model_path if hasattr(off, "server_args") else None
    from core.plan.default_model import default_model_path

    path = path or default_model_path()
    t0 = time.monotonic()
    with core.Engine(**kw, speculative_algorithm="standalone", speculative_draft_model_path=path,
                     speculative_draft_model_quantization="unquantized",
                     chunked_prefill_size=32) as on:
        got = on.generate(input_ids=ids, sampling_params=params)
        s = on.stats()
        on.check_accounting()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert s["spec_num_drafts"] > 0
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"], s
    assert s["spec_draft_free_pages"] == s["spec_draft_total_pages"]
    assert time.monotonic() - t0 < 600


# -- a request's own counts on /generate's meta_info (as the offline Engine's) -------------------

def test_generate_meta_info_carries_the_request_counts():
    from core.frontend.delta import Delta
    from core.messages import Finish
    from core.server.protocol import ParsedRequest
    from core.server.responses import SeqOut, generate_meta

    counts = {"spec_verify_ct": 2, "spec_draft_tokens": 8, "spec_accepted_tokens": 5}
    s = SeqOut(index=0, prompt_index=0, rid="x")
    s.add(Delta("x", 0, "a", (97,)))
    s.add(Delta("x", 0, "b", (98,), Finish("length"), 3, 2, 0,
                spec={**counts, "spec_note": None}))
    meta = generate_meta(s, ParsedRequest("generate", []), None, chr)
    assert {k: meta[k] for k in counts} == counts and "spec_note" not in meta
    plain = SeqOut(index=0, prompt_index=0, rid="y")
    plain.add(Delta("y", 0, "a", (97,), Finish("length"), 3, 1, 0))
    assert not any(k.startswith("spec") for k in generate_meta(
        plain, ParsedRequest("generate", []), None, chr))
