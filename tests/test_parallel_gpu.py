"""The parallel code paths on a GPU: a one-rank NCCL group through the same layers and
collectives as TP=N (the collectives are real NCCL calls, captured in the decode graphs),
data-parallel replicas sharing one GPU, and TP=2 where the machine has two GPUs."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import tiny_hf_model, write_config_model, write_tokenizer

import core
from conformance.model_configs import llama_config
from core.engine.distributed import free_loopback_port

pytestmark = pytest.mark.gpu

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


# Llama-3 layer shapes (heads of 128: the graph-safe attention backends take them), few layers
SMALL = llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                     max_position_embeddings=8192, rope_scaling=None, bos_token_id=1,
                     eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return write_config_model(tmp_path_factory.mktemp("par_gpu"), SMALL)


def run(path: str, load_format: str = "dummy", **kw) -> tuple[list[int], dict]:
    """Dummy weights by default (the same seed, so the same weights at one rank)."""
    with core.Engine(path, load_format=load_format, dtype="float32", max_total_tokens=4096,
                     device="cuda", **kw) as eng:
        out = eng.generate(input_ids=[PROMPT, PROMPT[:7]], sampling_params=GREEDY)
        return [o["output_ids"] for o in out], eng.info


def test_a_one_rank_nccl_group_gives_the_plain_engines_tokens(tiny):
    plain, _ = run(tiny)
    got, info = run(tiny, dist_init_addr=f"127.0.0.1:{free_loopback_port()}")
    assert any("rank 0 of 1 (nccl)" in n for n in info.notes), info.notes
    # the all-reduces were captured in the graphs
    assert info.cuda_graph_batch_sizes, info.notes
    assert got == plain


def test_two_replicas_on_one_gpu_give_one_engines_tokens(tiny):
    plain, _ = run(tiny)
    got, _ = run(tiny, dp_size=2)
    assert got == plain


def test_tp2_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs ({torch.cuda.device_count()} here)")
    path = tmp_path / "real"  # real weights: dummy ones are drawn per rank's shard
    tiny_hf_model("llama").save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    plain, _ = run(str(path), "safetensors")
    got, info = run(str(path), "safetensors", tp_size=2)
    assert any("rank 0 of 2 (nccl)" in n for n in info.notes)
    assert got == plain
