"""The parallel code paths on a GPU: a one-rank NCCL group through the same layers and
collectives as TP=N (the collectives are real NCCL calls, captured in the decode graphs),
data-parallel replicas sharing one GPU, and TP=2 where the machine has two GPUs."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import tiny_hf_model, write_tokenizer

import core
from core.distributed import free_loopback_port

pytestmark = pytest.mark.gpu

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tmp_path_factory.mktemp("par_gpu")
    tiny_hf_model("llama").save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return str(path)


def run(path: str, **kw) -> tuple[list[int], dict]:
    with core.Engine(path, dtype="float32", max_total_tokens=2048, device="cuda", **kw) as eng:
        out = eng.generate(input_ids=[PROMPT, PROMPT[:7]], sampling_params=GREEDY)
        return [o["output_ids"] for o in out], eng.info


def test_a_one_rank_nccl_group_gives_the_plain_engines_tokens(tiny):
    plain, _ = run(tiny)
    got, info = run(tiny, dist_init_addr=f"127.0.0.1:{free_loopback_port()}")
    assert any("rank 0 of 1 (nccl)" in n for n in info["notes"]), info["notes"]
    assert info["cuda_graph_batch_sizes"]  # the all-reduces were captured in the graphs
    assert got == plain


def test_two_replicas_on_one_gpu_give_one_engines_tokens(tiny):
    plain, _ = run(tiny)
    got, _ = run(tiny, dp_size=2)
    assert got == plain


def test_tp2_on_two_gpus(tiny):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs ({torch.cuda.device_count()} here)")
    plain, _ = run(tiny)
    got, info = run(tiny, tp_size=2)
    assert any("rank 0 of 2 (nccl)" in n for n in info["notes"])
    assert got == plain
