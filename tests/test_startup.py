"""Start-up without transformers (issue 19: model load at most 3 s on the CPU).

With its GGUF cache entry (core.plan.gguf_cache) in place, the default model's spec, config and
tokenizer load without importing transformers: what they read off transformers' objects was
kept as JSON the first time. These tests check that nothing transformers would have given is
lost: the same spec, the same config attributes, the same token ids, texts, special tokens and
chat template rendering as transformers' own tokenizer; and that transformers' tokenizer is
still there, built on first use, for the grammar backends that read it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A GGUF cache of its own, filled once by loading the default model's spec, config and
    tokenizer (which converts through transformers)."""
    where = tmp_path_factory.mktemp("gguf-cache")
    old = os.environ.get("CORE_GGUF_CACHE")
    os.environ["CORE_GGUF_CACHE"] = str(where)
    try:
        from core.engine.loader import find_weights, load_config
        from core.plan.default_model import default_model_path
        from core.plan.model_spec import load_model_spec
        from core.tokenizer import Tokenizer

        path = default_model_path()
        load_model_spec(path)
        source = find_weights(path, "auto")
        load_config(source)
        Tokenizer.from_path(source.directory, gguf_file=source.gguf_file)
        yield where
    finally:
        if old is None:
            os.environ.pop("CORE_GGUF_CACHE", None)
        else:
            os.environ["CORE_GGUF_CACHE"] = old


@pytest.fixture(scope="module")
def pair(cache_dir):
    """(our tokenizer on the `tokenizers` package, transformers' tokenizer of the same file)."""
    from core.plan.default_model import default_model_path
    from core.tokenizer import Tokenizer, _hf_tokenizer

    d, f = os.path.split(default_model_path())
    fast = Tokenizer.from_path(d, gguf_file=f)
    assert fast._fast is not None, "the GGUF tokenizer should run on the tokenizers package"
    return fast, Tokenizer(_hf_tokenizer(d, f))


def test_default_model_loads_its_spec_config_and_tokenizer_without_transformers(cache_dir):
    code = textwrap.dedent("""
        import json, os, sys
        from core.plan.default_model import default_model_path
        from core.engine.loader import find_weights, load_config
        from core.plan.model_spec import load_model_spec
        from core.tokenizer import Tokenizer

        path = default_model_path()
        spec = load_model_spec(path)
        source = find_weights(path, "auto")
        cfg = load_config(source)
        tok = Tokenizer.from_path(source.directory, gguf_file=source.gguf_file)
        ids = tok.encode("Hello, world!")
        chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        print(json.dumps({"transformers": "transformers" in sys.modules,
                          "layers": spec.num_layers, "vocab": cfg.vocab_size,
                          "ids": ids, "text": tok.decode(ids), "chat": chat}))
    """)
    env = dict(os.environ, CORE_GGUF_CACHE=str(cache_dir), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["transformers"], "transformers was imported by a warm-cache load"
    assert got["layers"] == 30 and got["vocab"] == 49152 and got["text"] == "Hello, world!"
    assert got["chat"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_cached_spec_is_the_one_read_from_the_header(cache_dir):
    from core.plan.default_model import default_model_path
    from core.plan.gguf_metadata import gguf_to_hf_config, read_gguf_metadata
    from core.plan.model_spec import load_model_spec, spec_from_config

    path = default_model_path()
    direct = spec_from_config(gguf_to_hf_config(read_gguf_metadata(path)), source=path)
    assert load_model_spec(path) == direct


def test_spec_to_dict_round_trips_through_json():
    from core.plan.model_spec import load_model_spec, spec_from_dict, spec_to_dict

    fixtures = REPO / "tests" / "fixtures" / "configs"
    for name in ("mixtral-8x7b.json", "qwen3-30b-a3b.json", "gemma-2-9b.json",
                 "deepseek-v2-lite.json", "llama-3.1-8b.json"):
        spec = load_model_spec(str(fixtures / name))
        assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec, name


def test_the_config_view_has_what_transformers_config_has(cache_dir):
    from core.engine.loader import ConfigView, _gguf_hf_config, find_weights, load_config
    from core.plan.default_model import default_model_path

    source = find_weights(default_model_path(), "auto")
    view = load_config(source)
    hf = _gguf_hf_config(source)
    hf._name_or_path = source.directory
    assert isinstance(view, ConfigView)
    assert view.to_dict() == hf.to_dict()
    # every attribute the models and the worker read, and every instance attribute
    read = {"head_dim", "num_key_value_heads", "mlp_bias", "hidden_act", "attention_bias",
            "tie_word_embeddings", "final_logit_softcapping", "sliding_window", "layer_types",
            "use_sliding_window", "max_window_layers", "rope_parameters", "rope_scaling",
            "rope_theta", "max_position_embeddings", "vocab_size", "eos_token_id",
            "quantization_config", "architectures", "model_type", "intermediate_size",
            "hidden_size", "num_attention_heads", "num_hidden_layers", "rms_norm_eps",
            "dtype", "torch_dtype", "qkv_bias", "num_local_experts", "num_experts_per_tok"}
    missing = object()
    for name in sorted(read | set(vars(hf))):
        ours, theirs = getattr(view, name, missing), getattr(hf, name, missing)
        assert ours == theirs, name
    view.max_position_embeddings = 64  # the loader's --context-length
    assert view.max_position_embeddings == 64 and view.to_dict()["max_position_embeddings"] == 64
    narrow = copy.copy(view)  # as Qwen2-MoE's experts narrow it
    narrow.intermediate_size = 8
    assert narrow.to_dict()["intermediate_size"] == 8
    assert view.intermediate_size == hf.intermediate_size == view.to_dict()["intermediate_size"]


def _corpus() -> list[str]:
    rng = random.Random(0)
    texts = ["", " ", "Hello, world!", "  leading and trailing  ", "\n\n\t tabs\tand\nlines",
             "Ünïcödé: 日本語のテキスト, Ελληνικά, emoji 🤖🚀 and 👩‍👩‍👧",
             "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
             "a<|im_end|>b <|endoftext|> c<repo_name>", "def f(x):\n    return x ** 2  # ok",
             "{\"json\": [1, 2.5, null, true], \"k\": \"v\"}", "1234567890 3.14159 -42",
             "<|im_start|", "im_end|>", "\u2581 sentencepiece-ish \u2581", "\x00\x01 control"]
    words = ["the", "capital", "of", "France", " Paris", "é", "中", "\n", "  ", "<|im_end|>",
             "token", "!", "🤖", "ﬁ", "İ"]
    for _ in range(40):
        texts.append("".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(30)))
    return texts


def test_the_fast_tokenizer_encodes_and_decodes_as_transformers(pair):
    fast, hf = pair
    for text in _corpus():
        for special in (True, False):
            assert fast.encode(text, special) == hf.encode(text, special), (text, special)
    rng = random.Random(1)
    id_lists = [[rng.randrange(fast.vocab_size) for _ in range(rng.randrange(1, 40))]
                for _ in range(200)]
    id_lists += [[0, 1, 2, 3], [1, 9690, 198, 2], [], [2]]
    for ids in id_lists:
        for skip in (True, False):
            assert fast.decode(ids, skip) == hf.decode(ids, skip), (ids, skip)


def test_the_fast_tokenizer_reads_the_same_vocabulary_facts(pair):
    fast, hf = pair
    assert fast.vocab_size == hf.vocab_size
    assert fast.eos_token_ids == hf.eos_token_ids
    assert fast.bos_token_id == hf.bos_token_id
    assert fast.special_tokens == hf.special_tokens
    assert fast.chat_template == hf.chat_template
    assert [fast.token_bytes(i) for i in range(fast.vocab_size)] == \
        [hf.token_bytes(i) for i in range(hf.vocab_size)]


def test_streaming_detokenization_is_the_same(pair):
    fast, hf = pair
    ids = hf.encode("Streaming Ünïcödé 日本語 🤖 text, word by word.\nNew line<|im_end|>")
    a, b = fast.detokenizer([1, 2]), hf.detokenizer([1, 2])
    assert [a.add(i) for i in ids] + [a.flush()] == [b.add(i) for i in ids] + [b.flush()]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Ünïcödé 日本語 🤖 \"quotes\" <b>html</b> & more"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather",
                                           "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "21", "name": "get_weather"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "Done.", "reasoning_content": "Hmm."},
     {"role": "assistant", "content": "Done.", "reasoning": "Old name."}],
]
TEMPLATES = [
    None,  # the model's own
    # tools, tool calls as JSON (tojson keeps non-ASCII), reasoning under its aliases
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content if m.content is defined else '' }}"
    "{% if m.thinking is defined %} [think: {{ m.thinking }} / {{ m.reasoning_content }}]"
    "{% endif %}{% for c in m.tool_calls or [] %}<{{ c.function.arguments | tojson }}>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    # trim_blocks / lstrip_blocks, namespace, loop controls, dict(), special tokens, a kwarg
    "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
    "  {% for m in messages %}\n"
    "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "    {% set ns.n = ns.n + 1 %}\n"
    "{{ ns.n }}. {{ m.content | trim }}{{ eos_token }}\n"
    "  {% endfor %}\n"
    "{{ dict(a=1) | tojson }} {{ (extra or 'none') }}",
    # the {% generation %} block renders its body
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}",
]


def _outcome(tok, chat, **kw):
    """The rendered text, or the error's kind and message (a template may refuse a chat)."""
    try:
        return "text", tok.apply_chat_template(chat, **kw)
    except Exception as exc:  # noqa: BLE001 - compared, kind and words
        return "error", type(exc).__name__, str(exc)


@pytest.mark.parametrize("template", range(len(TEMPLATES)))
def test_chat_templates_render_as_transformers_renders_them(pair, template):
    from core.tokenizer import Tokenizer

    fast, hf = pair
    if TEMPLATES[template] is not None:
        fast = Tokenizer._from_record(fast._fast, {
            "special_tokens_map": fast._special_map, "added_ids": sorted(fast._added_ids),
            "eos_token_id": None, "chat_template": None, "len": fast.vocab_size,
            "bos_token_id": fast.bos_token_id, "special_tokens": fast.special_tokens},
            fast._load_hf, fast._hf, chat_template=TEMPLATES[template])
        hf = Tokenizer(hf.hf, chat_template=TEMPLATES[template])
    for chat in CHATS:
        for gen in (True, False):
            for tools in (None, [WEATHER]):
                for kw in ({}, {"extra": "x ü"}):
                    want = _outcome(hf, chat, add_generation_prompt=gen, tools=tools, **kw)
                    assert _outcome(fast, chat, add_generation_prompt=gen, tools=tools,
                                    **kw) == want


def test_template_errors_are_transformers_kinds(pair):
    import jinja2

    from core.tokenizer import render_chat

    fast, _ = pair
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", CHATS[0], True, None, {}, {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{% set ns = namespace(_x=1) %}", CHATS[0], True, None, {}, {})
    with pytest.raises(ValueError, match="empty conversation"):  # transformers' own message
        fast.apply_chat_template([])


def test_transformers_tokenizer_is_built_on_first_use(pair):
    fast, _ = pair
    from core.tokenizer import Tokenizer

    lazy = Tokenizer._from_record(fast._fast, {
        "special_tokens_map": fast._special_map, "added_ids": sorted(fast._added_ids),
        "eos_token_id": 2, "chat_template": fast.chat_template, "len": fast.vocab_size,
        "bos_token_id": fast.bos_token_id, "special_tokens": fast.special_tokens},
        fast._load_hf)
    assert lazy._hf is None
    hf = lazy.hf  # what the grammar backends read
    assert len(hf) == lazy.vocab_size and lazy.hf is hf
    assert hf.convert_tokens_to_ids("<|im_end|>") == 2
