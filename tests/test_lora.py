"""Multi-LoRA serving (issue 36, first slice): PEFT adapters on the tiny Llama and Qwen3 match
HF transformers + PEFT (fp32, CPU) per adapter in mixed batches through core.Engine; adapters
that cannot be served are refused at load naming the problem; the resolver's LoRA slot; the
prefix cache keyed by adapter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# peft imports triton: a Triton test module collected after this one (the LoRA and MoE
# conformance suites) finds it imported already, so the interpreter is chosen here, as they do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("peft")

from model_fixtures import (  # noqa: E402
    LORA_ALL,
    greedy_reference,
    peft_reference,
    tiny_config,
    write_peft_adapter,
    write_tiny_model,
)

import core  # noqa: E402
from core.contract.lora import BASE_SLOT  # noqa: E402
from core.engine.lora import AdapterError, LoRAManager  # noqa: E402
from core.layers import ModelContext  # noqa: E402
from core.plan.args import make_server_args  # noqa: E402
from plugins.lora.torch_native.backend import TorchNativeLoRA  # noqa: E402

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 10, 20, 30, 40, 50, 60, 70, 80, 90],
           [256, 5, 4, 3], [256, 200, 201, 202, 203, 7]]
N_NEW = 8


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    """A tiny model and three random adapters: rank 8 on every projection, rank 16 with rslora
    on attention + down, rank 8 on k/v and gate/up only."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    model = write_tiny_model(arch, root / "model")
    adapters = {
        "a": write_peft_adapter(arch, root / "a", r=8, alpha=16, seed=1),
        "b": write_peft_adapter(arch, root / "b", r=16, alpha=8, use_rslora=True, seed=2,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                "down_proj")),
        "c": write_peft_adapter(arch, root / "c", r=8, alpha=32, seed=3,
                                target_modules=("k_proj", "v_proj", "gate_proj", "up_proj")),
    }
    return arch, model, adapters


def test_mixed_adapter_batches_match_hf_peft(served):
    """Requests for three adapters and the base in one batch, with two device slots (the third
    adapter waits for one): greedy tokens equal HF+PEFT's and logprobs within 1e-4."""
    arch, model, adapters = served
    want = {}
    for name in (*adapters, None):
        ref = peft_reference(arch, adapters[name] if name else None)
        want[name] = [greedy_reference(ref, p, N_NEW) for p in PROMPTS]
    loras = ["a", "b", None, "c", "b", "a", None, "c"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    with core.Engine(str(model), dtype="float32", max_total_tokens=1024, page_size=4,
                     lora_paths=[f"{n}={p}" for n, p in adapters.items()],
                     max_loras_per_batch=2) as engine:
        sp = {"max_new_tokens": N_NEW, "temperature": 0, "logprobs": True, "ignore_eos": True}
        outs = engine.generate(input_ids=prompts, lora_path=loras, sampling_params=sp)
        # the prefix cache is keyed by adapter: PROMPTS[0] was computed under a and b only
        again = {n: engine.generate(input_ids=PROMPTS[0], lora_path=n, sampling_params=sp)
                 for n in ("b", None)}
        stats = engine.stats()
    assert again["b"]["meta_info"]["cached_tokens"] > 0
    assert again[None]["meta_info"]["cached_tokens"] == 0
    for name, out in again.items():
        assert out["output_ids"] == want[name][0][0], name
    for i, (out, lora) in enumerate(zip(outs, loras, strict=True)):
        toks, lps = want[lora][i % len(PROMPTS)]
        assert out["output_ids"] == toks, (i, lora)
        got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(g - w) for g, w in zip(got, lps, strict=True)) < 1e-4, (i, lora)
    # the adapters really change the output (B is not zero), and differ from one another
    assert len({tuple(want[n][0][0]) for n in want}) == 4
    assert stats["lora_adapters"] == 3 and stats["lora_slot_loads"] >= 3


# -- adapters that cannot be served: refused at load, naming the problem --------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return write_peft_adapter("llama", tmp_path_factory.mktemp("good") / "a", r=8, alpha=16)


def _manager(max_rank: int = 16, targets=LORA_ALL) -> LoRAManager:
    from plugins.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config("llama"), ModelContext())
    backend = TorchNativeLoRA(None)
    return LoRAManager(model, backend, 2, max_rank, set(targets), torch.float32,
                       torch.device("cpu"))


def _copy(src, dst, config=None, tensors=None):
    """A copy of adapter `src` in `dst`, its config and tensors changed by the callables."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    ts = load_file(str(src / "adapter_model.safetensors"))
    if config is not None:
        config(cfg)
    if tensors is not None:
        tensors(ts)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(ts, str(dst / "adapter_model.safetensors"))
    return dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change,message", [
    (dict(config=lambda c: c.update(r=32)), "rank 32 is over --max-lora-rank 16"),
    (dict(config=lambda c: c.update(target_modules=["q_proj", "lm_head"])),
     "target module(s) lm_head not a projection"),
    (dict(tensors=lambda t: t.update({Q0.replace("layers.0", "layers.7") + ".lora_A.weight":
                                      t[Q0 + ".lora_A.weight"].clone(),
                                      Q0.replace("layers.0", "layers.7") + ".lora_B.weight":
                                      t[Q0 + ".lora_B.weight"].clone()})),
     "model.layers.7.self_attn.q_proj is not a projection of the base model"),
    (dict(tensors=lambda t: t.update({Q0 + ".lora_A.weight": t[Q0 + ".lora_A.weight"][:, :32].clone()})),
     "self_attn.q_proj has lora_A (8, 32)"),
    (dict(tensors=lambda t: t.pop(Q0 + ".lora_B.weight")), "q_proj has lora_B missing"),
    (dict(tensors=lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                      torch.zeros(8, 260)})),
     "is not a LoRA A or B weight"),
    (dict(config=lambda c: c.update(use_dora=True)), "DoRA (use_dora) is not supported"),
    (dict(config=lambda c: c.update(r="8")), "r must be a positive integer"),
    (dict(config=lambda c: c.update(peft_type="PREFIX_TUNING")), "is not LORA"),
    (dict(tensors=lambda t: t[Q0 + ".lora_B.weight"].fill_(float("nan"))), "non-finite"),
])
def test_bad_adapters_are_refused_naming_the_problem(adapter_dir, tmp_path, change, message):
    m = _manager()
    m.load("good", str(adapter_dir))
    bad = _copy(adapter_dir, tmp_path / "bad", **change)
    with pytest.raises(AdapterError, match=f"'bad'.*{_re(message)}"):
        m.load("bad", str(bad))
    assert list(m.adapters) == ["good"]  # a failed load changes nothing


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_malformed_files_and_names(adapter_dir, tmp_path):
    m = _manager()
    with pytest.raises(AdapterError, match="no such directory"):
        m.load("x", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        m.load("x", str(tmp_path / "empty"))
    (tmp_path / "empty" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not readable JSON"):
        m.load("x", str(tmp_path / "empty"))
    (tmp_path / "empty" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        m.load("x", str(tmp_path / "empty"))
    (tmp_path / "empty" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="not readable"):
        m.load("x", str(tmp_path / "empty"))
    m.load("a", str(adapter_dir))
    with pytest.raises(AdapterError, match="already loaded"):
        m.load("a", str(adapter_dir))
    with pytest.raises(AdapterError, match="not among the LoRA target modules"):
        _manager(targets=("q_proj", "v_proj")).load("a", str(adapter_dir))


def test_slots_are_lru_and_never_evict_a_held_adapter(adapter_dir, tmp_path):
    m = _manager()
    uids = [m.load(n, str(adapter_dir)).uid for n in ("x", "y", "z")]
    sx, sy = m.acquire(uids[0]), m.acquire(uids[1])
    assert {sx, sy} == {0, 1} and m.acquire(None) == BASE_SLOT
    assert m.acquire(uids[2]) is None  # both slots held: z waits
    m.release(sx)
    assert m.acquire(uids[2]) == sx  # x's slot, now free, goes to z
    assert m.acquire(uids[1]) == sy and m.refs[sy] == 2  # a resident adapter is shared
    scalings = m.projections[0].weights.scalings
    assert float(scalings[sx]) == pytest.approx(2.0)  # alpha 16 / r 8


def test_epilogue_adds_the_delta_only_for_adapter_tokens(adapter_dir):
    """Through the model's fused qkv projection: base tokens unchanged, adapter tokens get
    exactly scale * x A^T B^T in their q / k / v slices."""
    from safetensors.torch import load_file

    m = _manager()
    uid = m.load("a", str(adapter_dir)).uid
    slot = m.acquire(uid)
    lin, _ = m.targets["model.layers.0.self_attn.q_proj"]
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(5, lin.input_size)
    base = torch.nn.functional.linear(x, lin.weight)
    m.begin_step([2, 3], [BASE_SLOT, slot])
    y = lin.bound()(x)
    assert torch.equal(y[:2], base[:2])
    ts = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.0.self_attn."
    want = torch.cat([x[2:] @ ts[f"{pre}{p}.lora_A.weight"].T @ ts[f"{pre}{p}.lora_B.weight"].T
                      for p in ("q_proj", "k_proj", "v_proj")], dim=1) * 2.0
    assert torch.allclose(y[2:], base[2:] + want, atol=1e-5)


# -- flags and the plan -------------------------------------------------------------------------


def _plan(model_path, **kw):
    from core.engine.worker import make_plan

    if "device_profile" not in kw:  # the CPU's plan (torch_native LoRA), on a GPU machine too
        kw.setdefault("device", "cpu")
    return make_plan(make_server_args(model_path=str(model_path), **kw))[1]


def test_flags_and_plan(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config("llama").to_json_string())
    plan = _plan(cfg, enable_lora=True, max_lora_rank=32, max_loras_per_batch=3,
                 lora_target_modules=["q_proj", "down_proj"])
    assert (plan.lora_backend, plan.lora_slots, plan.lora_max_rank) == ("torch_native", 3, 32)
    assert plan.lora_target_modules == ("down_proj", "q_proj")
    assert any(n.startswith("LoRA: torch_native, 3 adapter slot(s)") for n in plan.notes)
    assert _plan(cfg).lora_backend is None
    # --lora-paths implies --enable-lora (SGLang), and says so
    plan = _plan(cfg, lora_paths=["a=/nowhere"], lora_modules=['{"name": "b", "path": "/x"}'])
    assert plan.lora_backend == "torch_native"
    assert any("2 adapter(s) named at start (--lora-paths implies" in n for n in plan.notes)
    with pytest.raises(ValueError, match="--max-lora-rank has no effect with LoRA off"):
        make_server_args(max_lora_rank=8)
    with pytest.raises(ValueError, match="--lora-backend has no effect"):
        make_server_args(lora_backend="torch_native")


def test_refusals_name_the_reason(tmp_path):
    from core.plan.plan import ResolveError

    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config("llama").to_json_string())
    with pytest.raises(ResolveError, match="--lora-target-modules: lm_head not a projection"):
        _plan(cfg, enable_lora=True, lora_target_modules=["lm_head"])
    with pytest.raises(ResolveError, match="given twice"):
        _plan(cfg, lora_paths=["a=/x", "a=/y"])
    with pytest.raises(ResolveError) as err:
        _plan(cfg, enable_lora=True, max_lora_rank=1000)
    assert "ranks up to 512 (--max-lora-rank 1000)" in str(err.value)
    with pytest.raises(ResolveError, match="unknown LoRA backend 'csgmv'"):
        _plan(cfg, enable_lora=True, lora_backend="csgmv")
    # both built-in backends shard adapters over tensor-parallel ranks (tests/test_lora_tp.py
    # has the refusal of one that does not)
    assert _plan(cfg, enable_lora=True, tp_size=2, device_profile="h100x2").lora_backend \
        == "triton"
    moe_cfg = Path(__file__).parent / "fixtures" / "configs" / "qwen3-30b-a3b.json"
    with pytest.raises(ResolveError, match="qwen3_moe takes no adapters"):
        _plan(moe_cfg, enable_lora=True, device_profile="h100")
    # a windowed model whose implementation takes no adapters (its hybrid KV pool aside)
    gemma = tmp_path / "gemma2.json"
    gemma.write_text(tiny_config("gemma2").to_json_string())
    with pytest.raises(ResolveError, match="gemma2 takes no adapters"):
        _plan(gemma, enable_lora=True)
    # (a quantized base a backend does not sit on: tests/test_lora_quant.py)
    # graph capture is turned off for a backend that is not graph safe, with a note
    plan = _plan(cfg, enable_lora=True, device_profile="h100", lora_backend="torch_native")
    assert not plan.cuda_graph
    assert any("LoRA backend torch_native cannot be captured" in n for n in plan.notes)
    # the GPU's default, triton, is graph safe: decode graphs stay on and hold the LoRA path
    # (steps serving adapters replay them); on an AWQ base too (the quant methods it sits on)
    for name in ("llama-3.1-8b.json", "llama-3.1-8b-awq.json"):
        plan = _plan(Path(__file__).parent / "fixtures" / "configs" / name, enable_lora=True,
                     device_profile="h100")
        assert plan.lora_backend == "triton" and plan.cuda_graph, plan.notes
        assert any(n.startswith("decode graphs capture the LoRA path (LoRA backend triton")
                   for n in plan.notes), plan.notes
        assert not any("run eagerly" in n and "LoRA" in n for n in plan.notes), plan.notes


# -- the prefix cache keyed by adapter ------------------------------------------------------------


def test_radix_cache_never_shares_prefixes_across_adapters():
    from core.engine.memory.memory_pool import PageAllocator
    from core.engine.memory.radix_cache import RadixCache

    alloc = PageAllocator(64, 2)
    cache = RadixCache(alloc, 2)
    toks = list(range(10))
    for ns in (None, 1):
        pages = alloc.alloc(5)
        cache.cache_finished(toks, pages, 0, None, ns=ns)
    assert len(cache.match_prefix(toks, None)[0]) == 5
    assert len(cache.match_prefix(toks, 1)[0]) == 5
    assert cache.match_prefix(toks, None)[0] != cache.match_prefix(toks, 1)[0]
    assert cache.match_prefix(toks, 2)[0] == []  # another adapter: nothing cached
    pages, node = cache.match_prefix(toks, 1)
    cache.lock(node)
    assert cache.evict(100) == 5  # the base model's tree goes; adapter 1's is locked
    assert cache.match_prefix(toks, None)[0] == [] and len(cache.match_prefix(toks, 1)[0]) == 5
    cache.unlock(node)
    assert cache.evict(100) == 5
    alloc.check_accounting(cache.cached_pages(), [])


# -- the HTTP server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """(offline Engine, server thread) of the tiny Llama with adapters a and b."""
    from conformance.server_kit import ServerThread
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.server.app import create_app

    root = tmp_path_factory.mktemp("lora-server")
    model = write_tiny_model("llama", root / "model")
    paths = {"a": write_peft_adapter("llama", root / "a", r=8, alpha=16, seed=1),
             "b": write_peft_adapter("llama", root / "b", r=16, alpha=16, seed=2)}
    args = make_server_args(model_path=str(model), dtype="float32", max_total_tokens=1024,
                            lora_paths=[f"a={paths['a']}"],
                            lora_modules=[json.dumps({"name": "b", "path": str(paths["b"])})])
    engine = Engine(server_args=args)
    try:
        with ServerThread(create_app(AsyncEngine(engine, "tiny"), args)) as srv:
            yield engine, srv, paths
    finally:
        engine.close()


def _post(srv, path, body):
    from conformance.server_kit import http_request

    status, _, raw = http_request(srv.url, "POST", path, body, timeout=120)
    return status, json.loads(raw)


def test_openai_model_selects_the_adapter(lora_server):
    engine, srv, _ = lora_server
    sp = {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    offline = {n: engine.generate(input_ids=PROMPTS[1], lora_path=n, sampling_params=sp)
               for n in ("a", "b", None)}
    assert len({tuple(o["output_ids"]) for o in offline.values()}) == 3
    for name in ("a", "b", "tiny"):
        status, body = _post(srv, "/v1/completions", {
            "model": name, "prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert status == 200, body
        assert body["model"] == name
        want = offline[None if name == "tiny" else name]["output_ids"]
        assert body["choices"][0]["token_ids"] == want, name
    status, body = _post(srv, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "a, b, tiny" in body["error"]["message"]


def test_generate_takes_lora_path(lora_server):
    engine, srv, _ = lora_server
    sp = {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    want = {n: engine.generate(input_ids=PROMPTS[2], lora_path=n, sampling_params=sp)["text"]
            for n in ("a", "b", None)}
    status, body = _post(srv, "/generate", {"input_ids": [PROMPTS[2]] * 3,
                                            "lora_path": ["a", None, "b"], "sampling_params": sp})
    assert status == 200, body
    assert [b["text"] for b in body] == [want["a"], want[None], want["b"]]
    status, body = _post(srv, "/generate", {"input_ids": PROMPTS[2], "lora_path": "b",
                                            "sampling_params": sp})
    assert status == 200 and body["text"] == want["b"]
    status, body = _post(srv, "/generate", {"input_ids": PROMPTS[2], "lora_path": "zzz"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _post(srv, "/generate", {"input_ids": PROMPTS[2], "lora_path": ["a", "b"]})
    assert status == 400 and body["error"]["param"] == "lora_path"
    status, body = _post(srv, "/generate", {"input_ids": PROMPTS[2], "lora_path": 7})
    assert status == 400 and body["error"]["param"] == "lora_path"


def test_models_lists_adapters_with_their_parent(lora_server):
    from conformance.server_kit import http_request

    _, srv, paths = lora_server
    status, _, raw = http_request(srv.url, "GET", "/v1/models")
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    assert status == 200 and set(cards) == {"tiny", "a", "b"}
    assert cards["tiny"]["parent"] is None
    for name in ("a", "b"):
        assert cards[name]["parent"] == "tiny" and cards[name]["root"] == str(paths[name])
        assert cards[name]["object"] == "model"
    status, _, raw = http_request(srv.url, "GET", "/v1/models/b")
    assert status == 200 and json.loads(raw)["parent"] == "tiny"
    status, _, raw = http_request(srv.url, "GET", "/v1/models/zzz")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_lora_path_with_lora_off_is_refused():
    from conformance.server_kit import FakeEngine, ServerThread
    from core.plan.args import ServerArgs
    from core.server.app import create_app

    with ServerThread(create_app(FakeEngine(), ServerArgs())) as srv:
        status, body = _post(srv, "/generate", {"text": "hi", "lora_path": "a"})
        assert status == 400 and "LoRA is off" in body["error"]["message"]
        status, body = _post(srv, "/v1/completions", {"model": "a", "prompt": "hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"


# -- adapters loaded and unloaded at run time -------------------------------------------------------


def test_load_and_unload_while_serving(lora_server, tmp_path):
    engine, srv, _ = lora_server
    c = write_peft_adapter("llama", tmp_path / "c", r=8, alpha=8, seed=7,
                           target_modules=("q_proj", "up_proj", "down_proj"))
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(c)})
    assert status == 200 and body["success"] and body["loaded_adapters"] == ["a", "b", "c"]
    want = greedy_reference(peft_reference("llama", c), PROMPTS[3], N_NEW)[0]
    status, body = _post(srv, "/v1/completions", {
        "model": "c", "prompt": PROMPTS[3], "max_tokens": N_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == want
    # refusals name the problem and change nothing
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(c)})
    assert status == 400 and "already loaded" in body["error"]["message"]
    big = write_peft_adapter("llama", tmp_path / "big", r=32, alpha=8, seed=8)
    status, body = _post(srv, "/v1/load_lora_adapter", {"lora_name": "big",
                                                        "lora_path": str(big)})
    assert status == 400 and "rank 32 is over --max-lora-rank 16" in body["error"]["message"]
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "d",
                                                     "lora_path": str(tmp_path / "none")})
    assert status == 400 and "no such directory" in body["error"]["message"]
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "d", "lora_path": "x",
                                                     "pinned": True})
    assert status == 400 and body["error"]["code"] == "unknown_parameter"
    status, body = _post(srv, "/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(c)})
    assert status == 400 and "served model" in body["error"]["message"]
    # an adapter a request still uses is not unloaded
    rid = engine.client.submit(input_ids=PROMPTS[0], params={
        "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}, lora="c")
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.unload_lora_adapter("c")
    engine.client.abort(rid)
    for _ in engine.client.stream(rid, timeout=60):
        pass
    status, body = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 200 and body["loaded_adapters"] == ["a", "b"]
    status, body = _post(srv, "/v1/completions", {"model": "c", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = _post(srv, "/unload_lora_adapter", {"lora_name": "c"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # a name loaded again from other weights never reuses what the old one computed (the
    # prefix cache keys by each load's id): PROMPTS[3] was cached under the first "c"
    c2 = write_peft_adapter("llama", tmp_path / "c2", r=16, alpha=8, seed=9)
    status, _ = _post(srv, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(c2)})
    assert status == 200 and engine.stats()["lora_adapters"] == 3
    want2 = greedy_reference(peft_reference("llama", c2), PROMPTS[3], N_NEW)[0]
    assert want2 != want
    status, body = _post(srv, "/v1/completions", {
        "model": "c", "prompt": PROMPTS[3], "max_tokens": N_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == want2


def test_admin_routes_are_guarded_and_refused_with_lora_off():
    from conformance.server_kit import FakeEngine, ServerThread, http_request
    from core.plan.args import ServerArgs
    from core.server.app import create_app

    with ServerThread(create_app(FakeEngine(), ServerArgs(api_key="sk-x"))) as srv:
        for path in ("/load_lora_adapter", "/v1/unload_lora_adapter"):
            status, _, _ = http_request(srv.url, "POST", path, {"lora_name": "a"})
            assert status == 401
        status, _, raw = http_request(srv.url, "POST", "/load_lora_adapter",
                                      {"lora_name": "a", "lora_path": "/x"},
                                      {"Authorization": "Bearer sk-x"})
        assert status == 400 and "LoRA is off" in json.loads(raw)["error"]["message"]


def test_a_bad_adapter_at_start_stops_the_engine_naming_it(served, tmp_path):
    arch, model, adapters = served
    bad = _copy(adapters["a"], tmp_path / "bad", config=lambda c: c.update(r=64))
    with pytest.raises(Exception, match="'bad'.*rank 64 is over --max-lora-rank 16"):
        core.Engine(str(model), dtype="float32", max_total_tokens=256, max_lora_rank=16,
                    lora_paths=[f"bad={bad}"])


# -- LoRA over a hybrid KV pool (windowed layers' pages given back) -------------------------------


def test_adapters_over_the_hybrid_kv_pool_match_hf_peft(tmp_path):
    """A tiny Qwen2 whose second layer has a sliding window (8 tokens): the hybrid KV pool is
    on, and requests under an adapter and the base, prompts and decoding well past the window,
    a repeat of each (prefix cache keyed by adapter, hits shortened where the window is gone),
    equal HF+PEFT's greedy tokens."""
    from model_fixtures import SLIDING_WINDOW, tiny_hf_model
    from peft import PeftModel

    w = SLIDING_WINDOW
    windowed = dict(sliding_window=w, use_sliding_window=True, max_window_layers=1,
                    layer_types=["full_attention", "sliding_attention"])
    model = write_tiny_model("qwen2", tmp_path / "model", **windowed)
    adapter = write_peft_adapter("qwen2", tmp_path / "a", r=8, alpha=16, seed=1)
    refs = {None: tiny_hf_model("qwen2", **windowed),
            "a": PeftModel.from_pretrained(tiny_hf_model("qwen2", **windowed),
                                           str(adapter)).eval()}
    prompts = [[256, *range(10, 10 + 3 * w + 3)], [256, 7, 8, 9]]
    new = 2 * w
    want = {n: [greedy_reference(ref, p, new)[0] for p in prompts] for n, ref in refs.items()}
    assert want["a"] != want[None]  # the adapter changes the output
    # and the window changes it too (the long prompt reads past it)
    assert greedy_reference(tiny_hf_model("qwen2"), prompts[0], new)[0] != want[None][0]
    loras = ["a", None, None, "a"]
    with core.Engine(str(model), dtype="float32", max_total_tokens=512, page_size=4,
                     chunked_prefill_size=16, swa_full_tokens_ratio=0.25,
                     lora_paths=[f"a={adapter}"]) as engine:
        assert any(n.startswith("hybrid KV pool (") for n in engine.info.notes), \
            engine.info.notes
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        for _ in range(2):  # the second round meets the first's cached prefixes
            outs = engine.generate(input_ids=[prompts[i % 2] for i in range(4)],
                                   lora_path=loras, sampling_params=sp)
            for i, (out, lora) in enumerate(zip(outs, loras, strict=True)):
                assert out["output_ids"] == want[lora][i % 2], (i, lora)
        stats = engine.stats()
        engine.check_accounting()
    assert 0 < stats["kv_group1_total_pages"] < stats["total_pages"]
