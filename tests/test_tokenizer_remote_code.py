"""--trust-remote-code reaches the tokenizer: a checkpoint whose tokenizer is its own code
(tokenizer_config.json's auto_map, as Kimi-K2's TikToken tokenizer) loads that code only when
the flag is given; without it the load is refused with a clear error, never asked about on the
terminal (transformers prompts when it is not told)."""

from __future__ import annotations

import json

import pytest
from model_fixtures import write_tokenizer

from core.tokenizer import Tokenizer

CODE = '''from transformers import PreTrainedTokenizerFast


class MarkedTokenizer(PreTrainedTokenizerFast):
    marked = True
'''


@pytest.fixture
def custom_dir(tmp_path):
    write_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]}
    cfg["tokenizer_class"] = "MarkedTokenizer"
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "tokenization_marked.py").write_text(CODE)
    return tmp_path


def test_custom_tokenizer_needs_trust_remote_code(custom_dir, monkeypatch):
    # a prompt would read stdin: make any read fail loudly instead of waiting
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked on the terminal"))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer.from_path(str(custom_dir))
    tok = Tokenizer.from_path(str(custom_dir), trust_remote_code=True)
    assert getattr(tok.hf, "marked", False)
    assert tok.decode(tok.encode("hi there", add_special_tokens=False)) == "hi there"
