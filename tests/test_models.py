"""Each architecture, loaded through core.engine.loader, matches transformers' logits (fp32, CPU).

The model runs over a paged KV cache (page size 4, scattered pages) with the torch_native backend:
prefill, then teacher-forced decode steps past Mistral's sliding window; a ragged batch of two
requests in one step; and a prefill over a cached (shared) prefix.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_fixtures import (
    SLIDING_WINDOW,
    PagedHarness,
    cpu_plan,
    tiny_hf_model,
    torch_native_backend,
    write_tiny_model,
)

from core.engine.loader import load_model
from core.layers import Linear
from core.plan.args import make_server_args
from core.plan.registry import build_registry
from plugins.hardware.cpu_runtime import pack_model as pack_for_cpu

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss"]
IMPL = {"llama3": "llama"}
MOE = {"gpt_oss"}  # architectures whose layers hold experts (the torch_native runner)
PAGE = 4
RTOL = 1e-4


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory, registry):
    """(our loaded model, transformers model, config) for one architecture."""
    arch = request.param
    path = write_tiny_model(arch, tmp_path_factory.mktemp(arch))
    plan = cpu_plan(IMPL.get(arch, arch), page_size=PAGE)
    if arch in MOE:
        plan = dataclasses.replace(plan, moe_runner="torch_native")
    loaded = load_model(make_server_args(model_path=str(path), load_format="safetensors"),
                        plan, registry)
    hf = tiny_hf_model(arch)  # same seed: the weights that were saved
    return loaded.model, hf, loaded.hf_config


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def step(model, batch):
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def assert_close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def harness(config, **kw):
    return PagedHarness(config.num_hidden_layers, config.num_key_value_heads,
                        getattr(config, "head_dim", None)
                        or config.hidden_size // config.num_attention_heads,
                        PAGE, backend=torch_native_backend(config, page_size=PAGE), **kw)


def test_prefill_then_decode_past_the_window(pair):
    model, hf, config = pair
    ids = tokens(2 * SLIDING_WINDOW + 6, seed=1)  # 22 tokens: 12 prefilled, 10 decoded
    ref = hf_logits(hf, ids)
    h = harness(config)
    prompt = 12
    assert_close(step(model, h.batch([0], [ids[:prompt]])), ref[:prompt])
    for t in range(prompt, len(ids)):
        assert_close(step(model, h.batch([0], [[ids[t]]], decode=True))[0], ref[t])


def test_ragged_batch_of_two(pair):
    model, hf, config = pair
    a, b = tokens(19, seed=2), tokens(14, seed=3)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    h = harness(config)
    out = step(model, h.batch([0, 1], [a[:7], b[:11]]))  # one step, two requests
    assert_close(out[:7], ref_a[:7])
    assert_close(out[7:], ref_b[:11])
    for i in range(3):  # decode both together
        out = step(model, h.batch([0, 1], [[a[7 + i]], [b[11 + i]]], decode=True))
        assert_close(out[0], ref_a[7 + i])
        assert_close(out[1], ref_b[11 + i])
    # request b is done; a alone continues past the window
    for t in range(10, 19):
        assert_close(step(model, h.batch([0], [[a[t]]], decode=True))[0], ref_a[t])


def test_extend_over_a_cached_prefix(pair):
    model, hf, config = pair
    shared = tokens(8, seed=4)
    a = shared + tokens(3, seed=5)
    b = shared + tokens(9, seed=6)
    h = harness(config)
    step(model, h.batch([0], [a]))  # fills the cache for the shared 8 tokens
    h.share_prefix(0, 1, len(shared))
    batch = h.batch([1], [b[len(shared):]])
    assert batch.prefix_lens_cpu == [len(shared)]
    assert_close(step(model, batch), hf_logits(hf, b)[len(shared):])


def test_weights_packed_for_cpu(pair):
    # What the model runner does on a CPU: linear weights (and the LM head) in oneDNN's layout.
    model, hf, config = pair
    packed = copy.deepcopy(model)
    pack_for_cpu(packed)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert packed.lm_head._packed is not None
    assert not packed.model.embed_tokens.weight.is_mkldnn  # rows are still looked up
    pack_for_cpu(packed)  # idempotent
    a, b = tokens(19, seed=2), tokens(14, seed=3)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    h = harness(config)
    out = step(packed, h.batch([0, 1], [a[:7], b[:11]]))
    assert_close(out[:7], ref_a[:7])
    assert_close(out[7:], ref_b[:11])
    for i in range(3):
        out = step(packed, h.batch([0, 1], [[a[7 + i]], [b[11 + i]]], decode=True))
        assert_close(out[0], ref_a[7 + i])
        assert_close(out[1], ref_b[11 + i])
    for t in range(10, 19):
        assert_close(step(packed, h.batch([0], [[a[t]]], decode=True))[0], ref_a[t])


def test_mistral_window_matters(tmp_path):
    # Without this, the Mistral cases above could pass with the window ignored.
    hf = tiny_hf_model("mistral")
    ids = tokens(2 * SLIDING_WINDOW + 4, seed=7)
    windowed = hf_logits(hf, ids)
    hf.config.sliding_window = None
    full = hf_logits(hf, ids)
    assert torch.allclose(windowed[:SLIDING_WINDOW], full[:SLIDING_WINDOW], atol=1e-5)
    assert not torch.allclose(windowed[SLIDING_WINDOW + 1:], full[SLIDING_WINDOW + 1:],
                              atol=1e-3)


def test_models_are_registered(registry):
    caps = {name: reg.caps.architectures for name, reg in registry.kind("models").items()}
    assert caps["llama"] == {"LlamaForCausalLM"}
    assert caps["mistral"] == {"MistralForCausalLM"}
    assert caps["qwen2"] == {"Qwen2ForCausalLM"}
    assert caps["qwen3"] == {"Qwen3ForCausalLM"}
