"""DeepSeek-V2 / V3 (plugins/models/deepseek_v2.py) against Hugging Face transformers' own
classes, fp32 on the CPU, through the engine (scheduler, radix cache, chunked prefill, model
runner) on the CPU's default MLA backend (cpu_c_mla*: decode in C over the latent pool) and on
the reference torch_native_mla: the log-probabilities of every prompt position and of
every decode step within 1e-4 of HF's.

Tiny random models: V2-Lite-like (q_lora_rank null, the first layer dense, 2 shared experts,
greedy routing), V2-like (q_lora_rank set, group_limited_greedy, routed_scaling_factor 1.5) and
V3-like (noaux_tc: sigmoid scores, a non-zero e_score_correction_bias, 4 groups ranked by their
top-2 sum, topk_group 2, norm_topk_prob, routed_scaling_factor 2.5), all with YaRN rope
(mscale != mscale_all_dim on V3, so both of its factors are exercised).
"""

from __future__ import annotations

import pytest
import torch
from hf_compare import check, greedy, hf_logprobs, run
from model_fixtures import VOCAB, write_tokenizer

from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import make_server_args

PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((29, 11))]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def tiny_config(kind: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256,
                  eos_token_id=258, pad_token_id=259, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=2, moe_intermediate_size=24, first_k_dense_replace=1)
    if kind == "v2_lite":
        return transformers.DeepseekV2Config(
            **common, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
            routed_scaling_factor=1.0, norm_topk_prob=False,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})
    if kind == "v2":
        return transformers.DeepseekV2Config(
            **common, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
            topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=False,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})
    if kind == "v3":
        return transformers.DeepseekV3Config(
            **common, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8})
    raise ValueError(kind)


def tiny_hf_model(kind: str, seed: int = 0):
    import transformers

    cfg = tiny_config(kind)
    cls = (transformers.DeepseekV3ForCausalLM if kind == "v3"
           else transformers.DeepseekV2ForCausalLM)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # larger than HF's init, so that every part moves the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                p.copy_(torch.randn_like(p) * 0.6 / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module", params=["v2_lite", "v2", "v3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    hf = tiny_hf_model(request.param)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    args, plan, _, registry = make_plan(make_server_args(model_path=str(path), dtype="float32",
                                                         device="cpu"))
    return request.param, str(path), hf, load_model(args, plan, registry)


def make_core(tiny, **kw):
    """An engine core on the tiny model; without attention_backend, the CPU's default MLA
    backend, which must be a cpu_c_mla build."""
    _, path, _, loaded = tiny
    kw.setdefault("max_total_tokens", 1024)
    args, plan, spec, registry = make_plan(make_server_args(model_path=path, dtype="float32",
                                                            device="cpu", **kw))
    assert plan.prefill_attention == plan.decode_attention
    if "attention_backend" in kw:
        assert plan.decode_attention == kw["attention_backend"]
    else:
        assert plan.decode_attention.startswith("cpu_c_mla")
    return build_engine_core(args, plan, spec, registry, loaded)


@pytest.mark.parametrize("scenario", [{}, {"chunked_prefill_size": 8, "page_size": 4},
                                      {"attention_backend": "torch_native_mla"}],
                         ids=["whole", "chunked", "reference"])
def test_prefill_and_every_decode_step_match_hf(tiny, scenario):
    _, _, hf, _ = tiny
    core = make_core(tiny, **scenario)
    done = run(core.scheduler, [(f"p{i}", p, greedy(6, prompt_k=2))
                                for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        check(done[f"p{i}"], p, hf, prompt_logprobs=True)
    core.scheduler.check_accounting()


def test_radix_cache_hit_matches_hf(tiny):
    """A second request sharing the first's prompt (whole pages) starts from the cached latent
    rows: its decode steps still match HF."""
    _, _, hf, _ = tiny
    core = make_core(tiny, page_size=4)
    sched = core.scheduler
    first = run(sched, [("warm", PROMPTS[0], greedy(2))])["warm"]
    check(first, PROMPTS[0], hf, prompt_logprobs=False)
    longer = PROMPTS[0][:24] + [5, 6, 7]
    done = run(sched, [("hit", longer, greedy(5))])
    assert done["hit"].cached_tokens >= 20
    check(done["hit"], longer, hf, prompt_logprobs=False)
    sched.check_accounting()


def test_kimi_k2_model_type_serves_as_v3(tiny, tmp_path):
    """Kimi-K2's config says model_type `kimi_k2` (its own configuration code, unknown to
    transformers) and architectures DeepseekV3ForCausalLM: without --trust-remote-code it is
    read with transformers' DeepseekV3Config and served by the same code, matching HF."""
    import json
    import shutil

    kind, path, hf, _ = tiny
    if kind != "v3":
        pytest.skip("Kimi-K2 is DeepSeek-V3's architecture")
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    cfg["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (kimi / "config.json").write_text(json.dumps(cfg))
    args, plan, spec, registry = make_plan(make_server_args(model_path=str(kimi),
                                                            dtype="float32",
                                                            max_total_tokens=512))
    assert plan.model_impl == "deepseek_v3"
    core = build_engine_core(args, plan, spec, registry)
    done = run(core.scheduler, [("k", PROMPTS[0], greedy(4))])
    check(done["k"], PROMPTS[0], hf, prompt_logprobs=False)


def test_mtp_layers_are_skipped_with_a_note(tiny):
    """V3 checkpoints carry the multi-token-prediction module as layer num_hidden_layers: it is
    skipped at load, and the load notes say so."""
    from core.layers import ModelContext
    from plugins.models.deepseek_v2 import DeepseekV3ForCausalLM
    from plugins.moe.torch_native.runner import TorchNativeMoE

    kind, _, hf, _ = tiny
    if kind != "v3":
        pytest.skip("V3 checkpoints carry the MTP layer")
    ours = DeepseekV3ForCausalLM(hf.config, ModelContext(moe_runner=TorchNativeMoE()))
    state = dict(hf.state_dict())
    n = hf.config.num_hidden_layers
    extra = {f"model.layers.{n}.{k.split('.', 3)[3]}": v for k, v in state.items()
             if k.startswith("model.layers.1.")}
    ours.load_weights(list(state.items()) + list(extra.items()))
    assert any(f"skipped checkpoint layers {n}" in note for note in ours.load_notes)


def test_dummy_weights_serve(tmp_path):
    """--load-format dummy from a V3 config alone: the engine plans, builds and decodes."""
    from model_fixtures import write_config_model

    cfg = tiny_config("v3").to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    path = write_config_model(tmp_path / "v3-dummy", cfg)
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=path, dtype="float32", load_format="dummy", max_total_tokens=256,
        device="cpu"))
    assert spec.attention_kind == "MLA" and spec.moe.correction_bias
    assert plan.model_impl == "deepseek_v3" and plan.decode_attention.startswith("cpu_c_mla")
    core = build_engine_core(args, plan, spec, registry)
    assert core.info.kv_bytes_per_token == 3 * (32 + 8) * 4  # one latent row per layer
    done = run(core.scheduler, [("d", PROMPTS[1], greedy(3))])
    assert len(done["d"].output_ids) == 3


def test_resolver_gives_noaux_tc_to_triton_only_where_declared():
    """The triton MoE runner routes with noaux_tc's correction bias (issue 34), so the H200 plan
    for V3 (and V2) takes it; with correction_bias undeclared it is refused for V3, saying why,
    not run with the bias ignored."""
    import dataclasses

    from core.plan.args import ServerArgs
    from core.plan.devices import PROFILES
    from core.plan.model_spec import spec_from_config
    from core.plan.registry import get_registry
    from core.plan.resolver import resolve

    registry = get_registry()
    v3 = tiny_config("v3").to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    assert resolve(spec_from_config(v3), PROFILES["h200"], ServerArgs(), registry
                   ).moe_runner == "triton"
    v2 = tiny_config("v2").to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    assert resolve(spec_from_config(v2), PROFILES["h200"], ServerArgs(), registry
                   ).moe_runner == "triton"
    reg = registry.get("moe", "triton")
    undeclared = dataclasses.replace(reg, caps=dataclasses.replace(reg.caps,
                                                                   correction_bias=False))
    entries = {k: dict(v) for k, v in registry.entries.items()}  # a copy: the shared one stays
    entries["moe"]["triton"] = undeclared
    plan = resolve(spec_from_config(v3), PROFILES["h200"], ServerArgs(),
                   dataclasses.replace(registry, entries=entries))
    assert plan.moe_runner == "torch_native"
    triton = next(c for c in plan.candidates if c.slot == "moe_runner" and c.name == "triton")
    assert not triton.fits
    assert any("correction bias" in r for r in triton.reasons), triton.reasons


def test_offline_engine_matches_hf(tmp_path):
    """core.Engine (the worker process, as `core serve` runs it) on the tiny V3: greedy tokens
    and each step's logprob as HF's; a second request over the same prompt hits the radix
    cache and decodes the same."""
    import core

    hf = tiny_hf_model("v3")
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path)
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
          "top_logprobs": 2}
    with core.Engine(str(tmp_path), dtype="float32", max_total_tokens=512, page_size=4) as eng:
        first = eng.generate(input_ids=PROMPTS[0], sampling_params=sp)
        again = eng.generate(input_ids=PROMPTS[0], sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] >= 24
    ref = hf_logprobs(hf, PROMPTS[0] + first["output_ids"])
    for out in (first, again):
        assert out["output_ids"] == first["output_ids"]
        for step, (lp, tok) in enumerate(out["meta_info"]["output_token_logprobs"]):
            row = ref[len(PROMPTS[0]) - 1 + step]
            assert tok == int(row.argmax())
            assert abs(lp - row[tok].item()) < 1e-4, (step, lp, row[tok].item())
