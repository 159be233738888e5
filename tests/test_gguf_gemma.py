"""Gemma 2 and Gemma 3 (text) from llama.cpp GGUF files (issue 35).

Tiny random transformers models are written as GGUF the way llama.cpp's converter writes Gemma
(convert_hf_to_gguf.py, Gemma2Model / Gemma3Model): tensor names through the gguf package's own
name map, every RMSNorm weight stored as 1 + w, no Q/K permutation, no lm_head (tied), the
metadata keys it writes and no others (no query_pre_attn_scalar, no layer pattern, no local
rope: llama.cpp sets those in code, and so must the loader). The configs are ones a GGUF can
say: query_pre_attn_scalar = head_dim (not a 27B), Gemma 3's sliding layers on rope base 10000
and every 6th layer global; windows shorter than the prompts.

Served from the F32 file, the engine matches the original HF model (fp32, 1e-4) through
prefill and decode past the window, and transformers' own reading of the file; served from
Q8_0 / Q4_0 blocks (the CPU default), it matches its dequantized load of the same file within
the kernels' activation rounding.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from model_fixtures import PagedHarness, cpu_plan, tiny_hf_model, torch_native_backend

from core.engine.loader import find_weights, load_config, load_model
from core.plan.args import make_server_args
from core.plan.registry import build_registry

W = 8  # the sliding window
RTOL = 1e-4
# Gemma's specials at their ids, the bytes, Gemma's end of turn in the last place (of 260)
TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(255)]
          + ["<end_of_turn>"])
# what a GGUF of each architecture can say (see the module docstring)
OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(
        query_pre_attn_scalar=16, num_hidden_layers=6, final_logit_softcapping=4.0,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 500.0}}),
}


def write_gemma_gguf(hf, path, qtype=None) -> str:
    """`hf` (a transformers Gemma2ForCausalLM / Gemma3ForCausalLM) as llama.cpp's converter
    writes it; `qtype`: a GGML block type for the 2-D weights (norms stay F32, as llama.cpp
    keeps 1-D tensors)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg.model_type]
    names = gguf.get_tensor_name_map(
        {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch],
        cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else
                    {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype.name])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])  # the global layers' base
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    # a sentencepiece ("llama") vocabulary (no eot key: llama.cpp's Gemma files have none)
    assert len(TOKENS) == cfg.vocab_size
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([3, 3, 3, 2] + [6] * 255 + [3])  # control, unknown, byte
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: the converter skips it
            continue
        base, suffix = name.rsplit(".", 1)
        data = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # llama.cpp's norm is x * w; HF's Gemma's x * (1 + w)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if qtype is not None and data.ndim == 2:
            q = quantize(data, qtype)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def files(request, tmp_path_factory):
    """(arch, the original HF model, {"F32" / "Q8_0" / "Q4_0": path of its GGUF})."""
    from gguf.constants import GGMLQuantizationType as T

    arch = request.param
    hf = tiny_hf_model(arch, **OVERRIDES[arch])
    d = tmp_path_factory.mktemp(f"gguf-{arch}")
    paths = {}
    for kind, qtype in (("F32", None), ("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0)):
        (d / kind).mkdir()
        paths[kind] = write_gemma_gguf(hf, d / kind / f"tiny-{arch}-{kind}.gguf", qtype)
    return arch, hf, paths


def load(registry, path, arch, quant_method="unquantized"):
    plan = dataclasses.replace(cpu_plan(arch), quant_method=quant_method)
    return load_model(make_server_args(model_path=path, dtype="float32"), plan, registry)


def tokens(n, seed):
    return torch.randint(4, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def served_logits(loaded, ids, prompt):
    """Logits of `ids`: `prompt` tokens prefilled, the rest decoded one at a time over the
    paged cache."""
    model, config = loaded.model, loaded.hf_config
    h = PagedHarness(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4,
                     backend=torch_native_backend(config))
    out = []
    with torch.inference_mode():
        batch = h.batch([0], [ids[:prompt]])
        out.append(model.compute_logits(model(batch.input_ids, batch.positions, batch)))
        for t in range(prompt, len(ids)):
            batch = h.batch([0], [[ids[t]]], decode=True)
            out.append(model.compute_logits(model(batch.input_ids, batch.positions, batch)))
    return torch.cat(out).float()


def assert_close(ours, ref, rtol=RTOL):
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def hf_read_of(path, original):
    """transformers' own model of the GGUF file: its config conversion and its tensor reader
    (names, dequantization, the 1 off the norms), with the fields its conversion drops (see
    test_the_config_is_what_llama_cpp_runs) set from the original model's config."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "layer_types", "rope_parameters"):
        setattr(config, key, getattr(original.config, key))
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def test_the_config_is_what_llama_cpp_runs(files):
    """The loader's config of the file equals the original model's in every field the model
    reads, though the file holds no query_pre_attn_scalar, layer pattern or local rope."""
    arch, hf, paths = files
    for kind in ("F32", "Q8_0"):
        config = load_config(find_weights(paths[kind]))
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                    "sliding_window", "layer_types", "rope_parameters", "head_dim",
                    "num_hidden_layers", "num_key_value_heads", "tie_word_embeddings",
                    "vocab_size"):
            got, want = getattr(config, key), getattr(hf.config, key)
            if key == "rope_parameters":  # compared by what rotary reads
                got = {k: {f: v[f] for f in ("rope_type", "rope_theta", "factor") if f in v}
                       for k, v in got.items()} if arch == "gemma3" else got
                want = {k: {f: v[f] for f in ("rope_type", "rope_theta", "factor") if f in v}
                        for k, v in want.items()} if arch == "gemma3" else want
            assert got == want, (kind, key, got, want)
        assert config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # stored as f32


def test_the_spec_plans_windows_and_soft_caps(files):
    from core.plan.model_spec import load_model_spec

    arch, hf, paths = files
    spec = load_model_spec(paths["Q8_0"])
    assert spec.architecture == {"gemma2": "Gemma2ForCausalLM",
                                 "gemma3": "Gemma3ForCausalLM"}[arch]
    assert spec.sliding_windows == tuple(W if t == "sliding_attention" else None
                                         for t in hf.config.layer_types)
    assert spec.final_logit_softcap == hf.config.final_logit_softcapping
    assert spec.logit_softcap == hf.config.attn_logit_softcapping
    assert spec.tie_word_embeddings


def test_f32_file_served_matches_hf_past_the_window(files, registry):
    """Prefill 12, then decode one at a time to 2 * W + 6 tokens: every logit within 1e-4 of
    the original model's, and of transformers' own reading of the same file."""
    arch, hf, paths = files
    loaded = load(registry, paths["F32"], arch)
    ids = tokens(2 * W + 6, seed=1)
    ours = served_logits(loaded, ids, prompt=12)
    assert_close(ours, hf_logits(hf, ids))
    assert_close(ours, hf_logits(hf_read_of(paths["F32"], hf), ids))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_blocks_kept_match_the_dequantized_file(files, registry, kind):
    """The CPU default for a quantized file keeps its blocks (a gguf_* quant method); its logits
    match the same file dequantized (whose own logits match transformers' read of the file
    within 1e-4). The block kernels round each activation block of 32 to int16 (at most
    1.5e-5 of the block's largest value; tests/test_gguf_quant.py checks the arithmetic) where
    the dequantized load multiplies in fp32. This tiny random model amplifies a perturbation
    about 100x (Q8_0's ~4e-3 weight rounding moves its logits by ~30% of their range; Gemma 3's
    six layers and q/k norms most), so the two agree to 2e-3 of the logits' range (measured:
    1.4e-4 Gemma 2, 7e-4 Gemma 3) and pick the same tokens."""
    from core.engine.worker import make_plan

    arch, hf, paths = files
    path = paths[kind]
    best = make_plan(make_server_args(model_path=path, dtype="float32"), registry)[1].quant_method
    assert best.startswith("gguf_"), best
    kept = load(registry, path, arch, best)
    layer = kept.model.model.layers[0].self_attn.qkv_proj
    assert layer.packed is not None and layer.packed.types == (kind,)
    assert layer.weight.numel() == 0  # no dense copy
    dense = load(registry, path, arch)
    ids = tokens(2 * W + 6, seed=2)
    ref = served_logits(dense, ids, prompt=12)
    assert_close(ref, hf_logits(hf_read_of(path, hf), ids))
    ours = served_logits(kept, ids, prompt=12)
    assert_close(ours, ref, rtol=2e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_the_engine_serves_the_files_greedy_like_hf(files):
    """`core serve`'s engine (the resolver's CPU plan), greedy past the window: on the F32 file
    the original model's tokens; on the Q8_0 file, served from its blocks, the tokens of
    transformers' (dequantized) read of that file."""
    from hf_compare import hf_greedy

    import core

    arch, hf, paths = files
    prompts = [tokens(2 * W + 3, seed=3), tokens(5, seed=4)]
    for kind, ref in (("F32", hf), ("Q8_0", hf_read_of(paths["Q8_0"], hf))):
        want = [hf_greedy(ref, p, 10) for p in prompts]
        with core.Engine(paths[kind], dtype="float32", max_total_tokens=512,
                         page_size=4) as engine:
            assert engine.plan.model_impl == arch
            if kind == "Q8_0":
                assert engine.plan.quant_method.startswith("gguf_")
                assert any("GGUF blocks kept" in n for n in engine.info.notes), engine.info.notes
            outs = engine.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
        assert [o["output_ids"] for o in outs] == want, kind


def test_the_tokenizer_ends_generation_at_the_end_of_turn(files):
    """Gemma's chat turns end with <end_of_turn>, which llama.cpp takes as end of generation
    though the file's eos_token_id is <eos>: both are EOS ids (cold and from the cache)."""
    import os

    from core.tokenizer import Tokenizer

    _, _, paths = files
    directory, name = os.path.split(paths["F32"])
    for _ in range(2):
        tok = Tokenizer.from_path(directory, gguf_file=name)
        assert tok.eos_token_ids == {1, 259}
        assert tok.encode("<end_of_turn>", add_special_tokens=False) == [259]


def test_core_resolve_plans_the_file(files, capsys):
    from core.cli import main

    arch, _, paths = files
    code = main(["resolve", "--json", "--model-path", paths["Q4_0"]])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["plan"]["model_impl"] == arch
    assert out["plan"]["quant_method"].startswith("gguf_")


# ---------------------------------------------------------------- header-only (no weights)

def _header(tmp_path, arch, layers, hidden=256, heads=8, head_dim=32, **keys):
    import gguf

    path = str(tmp_path / f"{arch}-{layers}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 2)
    w.add_key_length(head_dim)
    w.add_context_length(4096)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_27b_files_scale_by_hidden_over_heads(tmp_path):
    """llama.cpp picks Gemma's softmax scale by layer count: 1/sqrt(hidden / heads) for the 27B
    models (46 layers of Gemma 2, 62 of Gemma 3; HF: query_pre_attn_scalar 144 and 168), else
    1/sqrt(head_dim); Gemma 2's soft-caps and window default to 50, 30 and 4096."""
    from core.plan.gguf_metadata import gemma_config, read_gguf_metadata

    got = gemma_config(read_gguf_metadata(_header(tmp_path, "gemma2", 46, hidden=4608,
                                                  heads=32, head_dim=128)))
    assert got["query_pre_attn_scalar"] == 144
    assert (got["attn_logit_softcapping"], got["final_logit_softcapping"]) == (50.0, 30.0)
    assert got["sliding_window"] == 4096 and got["layer_types"][:2] == [
        "sliding_attention", "full_attention"]
    got = gemma_config(read_gguf_metadata(_header(
        tmp_path, "gemma3", 62, hidden=5376, heads=32, head_dim=128, sliding_window=1024,
        rope_freq_base=1e6)))
    assert got["query_pre_attn_scalar"] == 168
    assert got["layer_types"].count("full_attention") == 10  # layers 5, 11, ..., 59
    assert got["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    got = gemma_config(read_gguf_metadata(_header(tmp_path, "gemma3", 26, sliding_window=512)))
    assert got["query_pre_attn_scalar"] == 32  # head_dim


def test_gemma3_without_a_window_is_all_global_and_other_rope_scaling_is_refused(tmp_path):
    import gguf

    from core.plan.gguf_metadata import gemma_config, read_gguf_metadata

    got = gemma_config(read_gguf_metadata(_header(tmp_path, "gemma3", 6)))
    assert got["layer_types"] == ["full_attention"] * 6 and got["sliding_window"] is None
    path = _header(tmp_path / "..", "gemma3", 7, sliding_window=512,
                   rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=8.0)
    with pytest.raises(ValueError, match="rope scaling 'yarn'.*only linear"):
        gemma_config(read_gguf_metadata(path))
