"""core.plan.gguf_cache for model directories and across processes: what transformers reads out
of a model is built once per (files, transformers version), by one process at a time, and a
change to any file the entry is keyed by misses it (issue 37's start-up)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from core.plan import gguf_cache

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv("CORE_GGUF_CACHE", str(where))
    return where


def _build_slowly(path: str, log: str, out: str) -> None:
    """One process's cached_json of `path`: the build sleeps, then notes itself in `log`."""

    def build() -> dict[str, int]:
        time.sleep(1.0)
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return {"built_by": os.getpid()}

    value = gguf_cache.cached_json(path, "slow-part", build)
    Path(out).write_text(json.dumps(value))


def test_processes_missing_one_part_at_once_build_it_once(cache, tmp_path):
    model = tmp_path / "model.json"
    model.write_text("{}")
    log = tmp_path / "builds.log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_slowly, args=(str(model), str(log), str(tmp_path / f"{i}")),
                         daemon=True) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    builders = log.read_text().split()
    assert len(builders) == 1  # without the lock each of the three builds it
    values = {(tmp_path / f"{i}").read_text() for i in range(3)}
    assert values == {json.dumps({"built_by": int(builders[0])})}


def test_a_model_directorys_tokenizer_entry_follows_its_files(cache, tmp_path):
    from model_fixtures import write_config_model

    model = tmp_path / "model"
    write_config_model(model, json.loads(LLAMA.read_text()))
    first = gguf_cache.entry(str(model))
    assert first is not None and first == gguf_cache.entry(str(model))
    (model / "model-00001.safetensors").write_bytes(b"\0" * 8)  # weights: not in the key
    assert gguf_cache.entry(str(model)) == first
    config = model / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["model_max_length"] = 12345
    config.write_text(json.dumps(data))
    assert gguf_cache.entry(str(model)) != first  # a tokenizer file changed: a new entry


def test_a_model_directory_reads_back_the_same_tokenizer_and_config(cache, tmp_path):
    from model_fixtures import write_config_model

    from core.engine.loader import ConfigView, find_weights, load_config
    from core.tokenizer import Tokenizer

    model = tmp_path / "model"
    write_config_model(model, json.loads(LLAMA.read_text()))
    built = Tokenizer.from_path(str(model))  # builds the entry through transformers
    again = Tokenizer.from_path(str(model))  # reads it back: the `tokenizers` backend alone
    assert again._fast is not None and again._hf is None
    text = "Hello, world! <|im_start|>user\nwhat is 2+2?"
    assert again.encode(text) == built.hf.encode(text)
    ids = built.hf.encode(text)
    assert again.decode(ids) == built.hf.decode(ids, skip_special_tokens=True)
    assert again.eos_token_ids == built.eos_token_ids
    assert again.chat_template == built.chat_template
    source = find_weights(str(model), "dummy")
    hf = load_config(source)  # builds the record
    view = load_config(source)
    assert isinstance(view, ConfigView)
    assert view.dtype is torch.bfloat16  # a torch dtype survives the record
    names = [n for n in vars(hf) if not n.startswith("__")]
    assert {"hidden_size", "num_key_value_heads", "rope_parameters", "dtype"} <= set(names)
    for name in names:  # every attribute of transformers' config, read back equal
        assert getattr(view, name) == getattr(hf, name), name
    assert view.to_dict() == hf.to_dict()


FIXTURE_CONFIGS = sorted(p for p in (ROOT / "tests" / "fixtures" / "configs").glob("*.json")
                         if p.name != "foo-unknown.json")  # a type transformers does not know


@pytest.mark.parametrize("config", FIXTURE_CONFIGS, ids=lambda p: p.stem)
def test_every_fixture_configs_view_reads_as_transformers_config(cache, tmp_path, config):
    # the model code reads a restart's config through the view: every public attribute
    # transformers' config has (properties and class attributes too) must read back equal
    import shutil

    from core.engine.loader import ConfigView, find_weights, load_config

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(config, model / "config.json")
    source = find_weights(str(model), "dummy")
    hf = load_config(source)
    view = load_config(source)
    assert isinstance(view, ConfigView)  # each fixture's record is usable
    checked = 0
    for name in dir(hf):
        if name.startswith("_"):
            continue
        try:
            value = getattr(hf, name)
        except Exception:  # noqa: BLE001, S112 - a property transformers itself refuses
            continue
        if callable(value):
            continue
        assert getattr(view, name) == value, name
        checked += 1
    assert checked > 20
