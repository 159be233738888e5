"""GPT-OSS (plugins/models/gpt_oss.py) against transformers' own GptOssForCausalLM, fp32 on the
CPU, through the engine (resolver, scheduler, radix cache, chunked prefill, model runner) on the
torch_native attention (sinks, windows) and MoE (swigluoai, expert biases) backends: the
log-probabilities of every prompt position and of every decode step within 1e-4 of HF's, prompts
longer than the sliding window; greedy generation past the window through core.Engine equal to
transformers' generate. Per-step logits in the paged harness are in tests/test_models.py.

The tiny model (tests/model_fixtures.py "gpt_oss"): 3 layers (sliding, full, sliding; window
8), 4 heads over 2 KV heads with sinks of N(0, 1), YaRN (factor 4 over an original 64
positions, truncate false), 4 experts top-2 with biases, router bias, gate / up values of about
5 so that the SwiGLU's clamps at 7 bite. `test_every_gpt_oss_part_moves_the_logits` shows each part matters to HF's logits,
so a model that dropped one could not pass the comparisons.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hf_compare import check, greedy, hf_greedy, hf_logprobs, run
from model_fixtures import SLIDING_WINDOW, tiny_config, tiny_hf_model, write_tiny_model

from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args

# 29 and 11 tokens: both past the window of 8, the first past it by more than three windows
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((29, 11))]
CONFIGS = Path(__file__).parent / "fixtures" / "configs"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt-oss"))
    args, plan, _, registry = make_plan(make_server_args(model_path=str(path), dtype="float32"))
    return str(path), tiny_hf_model("gpt_oss"), load_model(args, plan, registry)


def make_core(tiny, **kw):
    path, _, loaded = tiny
    kw.setdefault("max_total_tokens", 1024)
    args, plan, spec, registry = make_plan(make_server_args(model_path=path, dtype="float32",
                                                            **kw))
    assert plan.model_impl == "gpt_oss" and plan.moe_runner == "torch_native"
    assert plan.decode_attention == "torch_native"  # the CPU backend that declares sinks
    return build_engine_core(args, plan, spec, registry, loaded)


@pytest.mark.parametrize("scenario", [{}, {"chunked_prefill_size": 8, "page_size": 4}],
                         ids=["whole", "chunked"])
def test_prefill_and_every_decode_step_match_hf(tiny, scenario):
    _, hf, _ = tiny
    core = make_core(tiny, **scenario)
    done = run(core.scheduler, [(f"p{i}", p, greedy(8, prompt_k=2))
                                for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        check(done[f"p{i}"], p, hf, prompt_logprobs=True)
    core.scheduler.check_accounting()


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-pool", "hybrid-pool"])
def test_radix_cache_hit_matches_hf(tiny, hybrid):
    """A second request sharing the first's prompt (whole pages) starts from its cached KV:
    its decode steps still match HF (the windowed layers included). With the hybrid KV pool
    the windowed layers gave back the pages behind their window, so a hit branching 24 tokens
    in is shortened to where they still hold KV (core.engine.memory.kv_groups) and recomputed
    from there."""
    _, hf, _ = tiny
    core = make_core(tiny, page_size=4, disable_hybrid_kv=not hybrid)
    assert any(n.startswith("hybrid KV pool (") for n in core.info.notes) == hybrid
    sched = core.scheduler
    first = run(sched, [("warm", PROMPTS[0], greedy(2))])["warm"]
    check(first, PROMPTS[0], hf, prompt_logprobs=False)
    longer = PROMPTS[0][:24] + [5, 6, 7]
    done = run(sched, [("hit", longer, greedy(6))])
    if hybrid:
        assert done["hit"].cached_tokens < 20
    else:
        assert done["hit"].cached_tokens >= 20
    check(done["hit"], longer, hf, prompt_logprobs=False)
    sched.check_accounting()


NEW = 12


def test_greedy_past_the_window_matches_transformers(tmp_path):
    """core.Engine (the worker process) against transformers' generate, greedy, fp32: a prompt
    past the window, a short one, one exactly the window; 12 new tokens each."""
    import core

    path = write_tiny_model("gpt_oss", tmp_path / "gpt-oss")
    hf = tiny_hf_model("gpt_oss")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist()
               for n in (2 * SLIDING_WINDOW + 3, 5, SLIDING_WINDOW)]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    with core.Engine(str(path), dtype="float32", max_total_tokens=512, page_size=4) as engine:
        assert engine.plan.model_impl == "gpt_oss"
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_every_gpt_oss_part_moves_the_logits():
    """HF's logits change when any one part is taken away (so the comparisons above would
    catch a model without it): the sinks, the window, YaRN, the SwiGLU clamp, the expert
    biases, the router bias, the attention biases."""
    hf = tiny_hf_model("gpt_oss")
    ids = PROMPTS[0]
    base = _logits(hf, ids)

    def without(change) -> torch.Tensor:
        model = copy.deepcopy(hf)
        with torch.no_grad():
            change(model)
        return _logits(model, ids)

    def zero(suffix):
        def change(model):
            for name, p in model.named_parameters():
                if name.endswith(suffix):
                    p.zero_()
        return change

    def no_window(model):
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.config.layer_types = ["full_attention"] * len(model.config.layer_types)

    def no_yarn(model):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

        cfg = copy.deepcopy(model.config)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        model.model.rotary_emb = GptOssRotaryEmbedding(cfg)

    def no_clamp(model):
        for layer in model.model.layers:
            layer.mlp.experts.limit = 1e9

    changes = {"sinks": zero("self_attn.sinks"), "window": no_window, "yarn": no_yarn,
               "clamp": no_clamp, "expert biases": zero("experts.gate_up_proj_bias"),
               "down biases": zero("experts.down_proj_bias"), "router bias": zero("router.bias"),
               "attention biases": zero("o_proj.bias")}
    for what, change in changes.items():
        moved = (without(change) - base).abs().max().item()
        assert moved > 1e-2, (what, moved)
    # the clamps bite: some gate / up values of the prompt pass 7
    seen = []
    hook = hf.model.layers[0].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.append(args[0]))
    _logits(hf, ids)
    hook.remove()
    experts = hf.model.layers[0].mlp.experts
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7).float().mean() > 0.05
    # the window: identical up to the window, different after it
    windowless = without(no_window)
    assert torch.allclose(windowless[:SLIDING_WINDOW], base[:SLIDING_WINDOW], atol=1e-5)


# ---- loading ----

def test_expert_tensors_are_de_interleaved_and_transposed():
    from plugins.models.gpt_oss import expert_tensor

    E, H, inter = 2, 3, 4
    gate_up = torch.arange(E * H * 2 * inter, dtype=torch.float32).view(E, H, 2 * inter)
    name, w13 = expert_tensor("gate_up_proj", gate_up)
    assert name == "w13_weight" and w13.shape == (E, 2 * inter, H)
    for i in range(inter):  # our row i is HF's column 2i (gate), row I + i its column 2i + 1
        assert torch.equal(w13[:, i], gate_up[:, :, 2 * i])
        assert torch.equal(w13[:, inter + i], gate_up[:, :, 2 * i + 1])
    name, b13 = expert_tensor("gate_up_proj_bias", torch.arange(2 * inter).repeat(E, 1))
    assert name == "w13_bias" and b13[0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    down = torch.randn(E, inter, H)
    name, w2 = expert_tensor("down_proj", down)
    assert name == "w2_weight" and torch.equal(w2, down.transpose(1, 2))
    assert expert_tensor("down_proj_bias", torch.ones(E, H))[0] == "w2_bias"
    assert expert_tensor("gate_up_proj_blocks", torch.zeros(E, 8, 1, 16, dtype=torch.uint8)) \
        is None  # MXFP4: the mxfp4 quant method's loader, not this layout
    with pytest.raises(ValueError, match="must be even"):
        expert_tensor("gate_up_proj", torch.zeros(E, H, 7))


def test_an_mxfp4_checkpoint_is_named_not_misread(tiny):
    """MXFP4 blocks without their scales are refused by name, never loaded as something else
    (whole pairs load: tests/test_gpt_oss_mxfp4.py); a missing expert tensor is named by its
    parameter."""
    _, hf, loaded = tiny
    model = type(loaded.model)(loaded.hf_config, loaded.model.ctx)  # unpacked (the engine packs)
    state = dict(hf.state_dict())
    blocks = {k.replace("gate_up_proj", "gate_up_proj_blocks"): torch.zeros(1, dtype=torch.uint8)
              for k in state if k.endswith("experts.gate_up_proj")}
    partial = {k: v for k, v in state.items() if not k.endswith("experts.gate_up_proj")}
    with pytest.raises(ValueError, match="MXFP4 blocks and scales come in pairs; alone: "
                                         "model.layers.0.mlp.experts.gate_up_proj_blocks"):
        model.load_weights({**partial, **blocks}.items())
    with pytest.raises(ValueError, match="missing tensors: model.layers.0.mlp.w13_weight"):
        model.load_weights(partial.items())
    model.load_weights(state.items())  # and the whole state loads again


def test_sinks_and_biases_reach_the_backends(tiny):
    _, hf, loaded = tiny
    model = type(loaded.model)(loaded.hf_config, loaded.model.ctx)
    model.load_weights(hf.state_dict().items())
    for i, layer in enumerate(model.model.layers):
        ref = hf.model.layers[i]
        params = layer.self_attn.attn.params
        assert params.sinks is layer.self_attn.sinks  # loaded in place, not a copy
        torch.testing.assert_close(params.sinks, ref.self_attn.sinks.detach(), rtol=0, atol=0)
        assert params.sliding_window == (SLIDING_WINDOW if i % 2 == 0 else None)
        moe = layer.mlp
        w = moe.weights()
        assert set(w.extra) >= {"w13_bias", "w2_bias"}
        assert moe.params.activation == "swigluoai" and moe.params.swiglu_limit == 7.0
        assert moe.params.renormalize and moe.gate.bias is not None
        torch.testing.assert_close(moe.gate.bias, ref.mlp.router.bias.detach(), rtol=0, atol=0)


def test_dummy_weights_serve(tmp_path):
    """--load-format dummy from a config alone (gpt-oss-20b's, shrunk): plans, builds, decodes."""
    from model_fixtures import write_config_model

    cfg = json.loads((CONFIGS / "gpt-oss-20b-bf16.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=260,
               layer_types=["sliding_attention", "full_attention"], sliding_window=4,
               torch_dtype="float32", max_position_embeddings=256, eos_token_id=258,
               pad_token_id=259)
    path = write_config_model(tmp_path / "gpt-oss-dummy", cfg)
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=path, dtype="float32", load_format="dummy", max_total_tokens=256))
    assert spec.attention_sinks and spec.moe.expert_bias and spec.moe.activation == "swigluoai"
    assert plan.model_impl == "gpt_oss" and plan.moe_runner == "torch_native"
    core = build_engine_core(args, plan, spec, registry)
    done = run(core.scheduler, [("d", PROMPTS[0], greedy(3))])
    assert len(done["d"].output_ids) == 3


# ---- planning ----

def _resolve(name: str, profile: str):
    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.model_spec import load_model_spec
    from core.plan.registry import get_registry
    from core.plan.resolver import resolve

    return resolve(load_model_spec(str(CONFIGS / name)), PROFILES[profile], ServerArgs(),
                   get_registry())


@pytest.mark.parametrize("profile", ["h200", "x86-cpu"])
def test_bf16_gpt_oss_20b_plans_fully(profile):
    """gpt-oss-20b's config with bf16 experts (no quantization_config): every slot filled by a
    backend that declares what it needs: sinks and windows for attention, swigluoai and expert
    biases for the experts. On the H200 that is the triton MoE runner (both fused in its
    kernels), chosen over torch_native by priority."""
    from core.plan.registry import get_registry

    plan = _resolve("gpt-oss-20b-bf16.json", profile)
    registry = get_registry()
    assert plan.model_impl == "gpt_oss" and plan.quant_method == "unquantized"
    for slot in ("prefill_attention", "decode_attention"):
        caps = registry.get("attention", getattr(plan, slot)).caps
        assert caps.sinks and caps.sliding_window, getattr(plan, slot)
    moe = registry.get("moe", plan.moe_runner).caps
    assert "swigluoai" in moe.activations and moe.expert_bias
    if profile == "h200":
        triton = next(c for c in plan.candidates if c.slot == "moe_runner"
                      and c.name == "triton")
        assert triton.fits and triton.chosen and plan.moe_runner == "triton", triton.reasons


def test_tiny_config_is_read_like_transformers():
    from core.plan.model_spec import spec_from_config

    spec = spec_from_config(tiny_config("gpt_oss"))
    assert spec.sliding_windows == (SLIDING_WINDOW, None, SLIDING_WINDOW)
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_scaling["truncate"] is False
    assert (spec.moe.swiglu_alpha, spec.moe.swiglu_limit) == (1.702, 7.0)


# ---- on a CUDA device (`pytest -m gpu tests/test_gpt_oss.py`) ----

@pytest.mark.gpu
def test_cuda_fp32_tiny_matches_hf(tmp_path):
    """The tiny model on a GPU, fp32 (head dim 16: torch_native attention; the triton MoE
    runner, swigluoai and expert biases in its kernels): greedy tokens and each step's
    logprob as HF's on the CPU."""
    import core

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = write_tiny_model("gpt_oss", tmp_path / "gpt-oss")
    hf = tiny_hf_model("gpt_oss")
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
          "top_logprobs": 2}
    with core.Engine(str(path), dtype="float32", device="cuda", max_total_tokens=512,
                     page_size=4) as eng:
        assert eng.plan.moe_runner == "triton"
        outs = eng.generate(input_ids=PROMPTS, sampling_params=sp)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_logprobs(hf, prompt + out["output_ids"])
        for step, (lp, tok) in enumerate(out["meta_info"]["output_token_logprobs"]):
            row = ref[len(prompt) - 1 + step]
            assert tok == int(row.argmax()), step
            assert abs(lp - row[tok].item()) < 1e-4, (step, lp, row[tok].item())


def _gpt_oss_20b(tmp_path, layers: int) -> str:
    """gpt-oss-20b's config (bf16 experts), its first `layers` layers."""
    from model_fixtures import write_config_model

    cfg = json.loads((CONFIGS / "gpt-oss-20b-bf16.json").read_text())
    cfg.update(num_hidden_layers=layers, layer_types=cfg["layer_types"][:layers])
    return write_config_model(tmp_path / f"gpt-oss-20b-{layers}", cfg)


def _first_step_top(path: str, dtype: str, backend: str | None, new: int = 4,
                    moe: str | None = None):
    import core

    prompt = [(13 * j) % 199000 + 100 for j in range(300)]  # past the 128-token window
    kw = {"attention_backend": backend} if backend else {}
    if moe:
        kw["moe_runner_backend"] = moe
    with core.Engine(path, load_format="dummy", device="cuda", dtype=dtype,
                     max_total_tokens=4096, **kw) as eng:
        chosen = eng.plan.decode_attention
        out = eng.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 5})
    assert len(out["output_ids"]) == new
    return chosen, {t: lp for lp, t in out["meta_info"]["output_top_logprobs"][0]}


@pytest.mark.gpu
def test_cuda_fp32_triton_sinks_agree_with_torch_native_at_gpt_oss_20b_shapes(tmp_path):
    """gpt-oss-20b's shapes (64 heads of 64 over 8 KV heads, sinks, a 128-token window on
    alternate layers, YaRN, 32 biased experts), 4 layers, dummy weights, fp32: the resolver's
    triton attention gives torch_native's first-step log-probabilities (on an H100: 9.5e-6
    apart, the same top 5). In bf16 the two part by 0.25 at 4 layers and share no top-5 token
    at 12: random routers sit near ties, and a flipped expert moves the output (a dummy
    model's trait: fp32 is the check of the kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = _gpt_oss_20b(tmp_path, 4)
    chosen, triton = _first_step_top(path, "float32", None)
    _, native = _first_step_top(path, "float32", "torch_native")
    assert chosen == "triton"
    assert set(triton) == set(native)
    for t in triton:
        assert abs(triton[t] - native[t]) < 1e-4, (t, triton[t], native[t])


@pytest.mark.gpu
def test_cuda_fp32_triton_experts_agree_with_torch_native_at_gpt_oss_20b_shapes(tmp_path):
    """The same 4 layers of gpt-oss-20b's shapes, fp32, triton attention either way: the
    triton MoE runner (swigluoai, expert biases, under CUDA graphs) gives torch_native's
    first-step log-probabilities."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = _gpt_oss_20b(tmp_path, 4)
    _, fused = _first_step_top(path, "float32", "triton", moe="triton")
    _, native = _first_step_top(path, "float32", "triton", moe="torch_native")
    assert set(fused) == set(native)
    for t in fused:
        assert abs(fused[t] - native[t]) < 1e-4, (t, fused[t], native[t])


@pytest.mark.gpu
def test_cuda_bf16_gpt_oss_20b_dummy_serves_past_the_window(tmp_path):
    """The whole gpt-oss-20b with bf16 experts (dummy weights, about 42 GB): planned (triton
    attention with sinks, triton experts), a prompt past the window prefilled and decoded."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2 ** 30:
        pytest.skip("needs about 45 GB of GPU memory")
    chosen, top = _first_step_top(_gpt_oss_20b(tmp_path, 24), "bfloat16", None, new=16)
    assert chosen == "triton"
    assert len(top) == 5 and all(lp <= 0 for lp in top.values())
