"""Tensor parallelism on the CPU with gloo: every rank a process, greedy output equal to one
rank's and to transformers' (fp32), the resolver's refusals, and the ranks' lifecycle (abort,
retraction, shutdown with no process left behind, a dead rank bringing the engine down with
the reason, several nodes on loopback)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from model_fixtures import tiny_hf_model, write_tokenizer
from test_moe_models import tiny_moe_hf_model

import core
from core.engine.distributed import TPGroup, fitting_tp_sizes, free_loopback_port, tp_problems
from core.engine.worker import make_plan
from core.plan.args import make_server_args
from core.plan.plan import ResolveError

N_TOKENS = 64
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
GREEDY = {"max_new_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (full forward each step, fp32)."""
    ids = list(ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
    return out


def write(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return path


def engine(path: Path, tp: int, **kw) -> core.Engine:
    return core.Engine(str(path), dtype="float32", max_total_tokens=kw.pop("max_total_tokens",
                                                                            1024),
                       tp_size=tp, device="cpu", **kw)


def rank_pids(eng: core.Engine) -> list[int]:
    return [eng.client.process.pid, *(p.pid for p in eng.client.ranks)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ---- sizes (no processes) ----

def test_group_sizes_split_heads_kv_and_vocab():
    g = TPGroup(rank=1, size=2)
    assert g.split(8) == (4, 4)
    assert g.kv_heads(2) == (1, 1)
    assert TPGroup(rank=3, size=4).kv_heads(2) == (1, 1)  # replicated: ranks 2, 3 hold head 1
    assert TPGroup(rank=1, size=4).kv_heads(2) == (0, 1)
    assert TPGroup(rank=2, size=3).vocab_part(260) == (174, 87)  # padded: 3 x 87 = 261
    with pytest.raises(ValueError, match="does not split over 2"):
        g.split(9, "attention heads")


def test_problems_name_every_size_that_does_not_split():
    sizes = {"intermediate_size": 1536}
    assert tp_problems(9, 3, sizes, 3) == []
    assert tp_problems(9, 3, sizes, 2) == [
        "9 attention heads do not split over 2 ranks",
        "3 KV heads neither split over 2 ranks nor replicate evenly onto them"]
    assert fitting_tp_sizes(9, 3, sizes) == [1, 3]
    assert tp_problems(8, 2, {"moe_intermediate_size": 96}, 4) == []
    assert tp_problems(8, 2, {"moe_intermediate_size": 90}, 4) == [
        "moe_intermediate_size 90 does not split over 4 ranks"]


def test_resolver_refuses_smollm2_at_tp2_naming_the_sizes_that_work():
    with pytest.raises(ResolveError) as info:
        make_plan(make_server_args(tp_size=2, device="cpu"))
    text = str(info.value)
    assert "does not split over --tp-size 2" in text
    assert "9 attention heads do not split over 2 ranks" in text
    assert "that split its 9 heads, 3 KV heads and MLP widths: 1, 3" in text


def test_resolver_picks_a_splittable_quant_method_and_says_why_others_are_out():
    _, plan, _, _ = make_plan(make_server_args(tp_size=3, device="cpu"))
    assert plan.quant_method == "unquantized"  # the GGUF blocks are dequantized at load
    rejected = [c for c in plan.candidates if c.slot == "quant_method" and c.name.startswith(
        "gguf")]
    assert rejected and all(any("do not split over tensor-parallel ranks" in r
                                for r in c.reasons) for c in rejected)
    assert any("tensor parallel over 3 ranks: 3 heads per rank" in n for n in plan.notes)


def test_expert_parallel_plan_and_refusals(tmp_path):
    path = write(tiny_moe_hf_model("qwen3_moe"), tmp_path / "moe")
    _, plan, _, _ = make_plan(make_server_args(model_path=str(path), tp_size=2, ep_size=2,
                                               device="cpu"))
    assert plan.moe_runner == "torch_native"
    assert any("expert parallel over 2 ranks: 4 whole experts per rank" in n
               for n in plan.notes)
    dense = write(tiny_hf_model("llama"), tmp_path / "dense")
    with pytest.raises(ResolveError, match="--ep-size 2 has no effect: LlamaForCausalLM has no"):
        make_plan(make_server_args(model_path=str(dense), tp_size=2, ep_size=2, device="cpu"))


# ---- greedy equality, per architecture ----

@pytest.mark.parametrize("arch,ep", [
    ("llama", 1),  # CI runs llama; the others are slow (`pytest -m 'not gpu'` runs them)
    pytest.param("qwen3", 1, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 1, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 2, marks=pytest.mark.slow),
    # sinks split by head, expert biases by rows (down's bias on rank 0) or by experts
    pytest.param("gpt_oss", 1, marks=pytest.mark.slow),
    pytest.param("gpt_oss", 2, marks=pytest.mark.slow)])
def test_tp2_greedy_equals_tp1_and_transformers(arch, ep, tmp_path):
    """ep 2: the experts placed whole on the two ranks instead of split."""
    hf = tiny_moe_hf_model(arch) if arch.endswith("moe") else tiny_hf_model(arch)
    path = write(hf, tmp_path / arch)
    want = hf_greedy(hf, PROMPT, N_TOKENS)
    got, sampled, constrained = {}, {}, {}
    for tp in (1, 2):
        with engine(path, tp, **({"ep_size": ep} if tp == 2 else {})) as eng:
            got[tp] = eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
            if arch == "llama":  # seeded sampling: every rank draws the same tokens
                sampled[tp] = eng.generate(input_ids=PROMPT, sampling_params={
                    **GREEDY, "temperature": 1.0, "top_p": 0.9, "seed": 7})["output_ids"]
                # structured output: the compile ends on every rank at rank 0's word
                constrained[tp] = eng.generate(input_ids=PROMPT, sampling_params={
                    "max_new_tokens": 60, "temperature": 0, "constraint": {
                        "kind": "regex", "value": "[a-z]{3,9}( [a-z]{2,8}){1,4}\\."}})
            if tp == 2:
                notes = eng.client.info.notes
                assert any("tensor parallel: rank 0 of 2 (gloo)" in n for n in notes)
                # CPU decode graphs replay the all-reduce (plugins/hardware/cpu_graphs.py)
                captured = any(n.startswith("captured decode graphs") for n in notes)
                assert captured == eng.plan.cuda_graph, notes
    assert got[2] == got[1]
    assert got[2] == want
    assert sampled.get(2) == sampled.get(1)
    if constrained:
        assert constrained[2]["output_ids"] == constrained[1]["output_ids"]
        assert re.fullmatch(r"[a-z]{3,9}( [a-z]{2,8}){1,4}\.", constrained[2]["text"]), \
            constrained[2]["text"]


@pytest.mark.slow  # ~50 s on a loaded 2-core CPU; CI keeps the tiny tp2 llama above
def test_smollm2_tp3_greedy_equals_transformers():
    from hf_reference import hf_gguf_model

    from core.engine.loader import load_tokenizer
    from core.plan.default_model import default_model_path

    hf = hf_gguf_model(default_model_path())
    ids = load_tokenizer(make_server_args()).encode("The capital of France is")
    want = hf_greedy(hf, ids, 24)
    with core.Engine(dtype="float32", max_total_tokens=512, tp_size=3, device="cpu") as eng:
        got = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24})
    assert got["output_ids"] == want


# ---- one TP=2 engine: concurrency, retraction, abort, accounting ----

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    hf = tiny_hf_model("llama")
    return hf, write(hf, tmp_path_factory.mktemp("tp_llama"))


@pytest.fixture(scope="module")
def tp2(tiny_llama):
    # a small pool (and page): 8 requests of ~100 tokens do not fit at once -> retraction
    with engine(tiny_llama[1], 2, max_total_tokens=320, page_size=4,
                chunked_prefill_size=64) as eng:
        yield eng


def test_concurrent_requests_with_retraction_match_their_solo_output(tp2, tiny_llama):
    hf, _ = tiny_llama
    prompts = [[256, *range(60 + i, 90 + i)] for i in range(8)]
    params = {"max_new_tokens": 70, "temperature": 0, "ignore_eos": True}
    outs = tp2.generate(input_ids=prompts, sampling_params=params)
    for p, out in zip(prompts[:3], outs[:3], strict=False):
        assert out["output_ids"] == hf_greedy(hf, p, 70)
    solo = [tp2.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts[3:]]
    assert [o["output_ids"] for o in outs[3:]] == solo
    stats = tp2.client.stats()
    assert stats["retractions"] > 0, stats  # the pool was too small for all at once
    tp2.client.check_accounting()


def test_abort_mid_stream_leaves_the_ranks_in_step(tp2, tiny_llama):
    hf, _ = tiny_llama
    client = tp2.client
    rid = client.submit(input_ids=PROMPT, params={"max_new_tokens": 200, "temperature": 0,
                                                  "ignore_eos": True})
    for chunk in client.stream(rid, timeout=60):
        if chunk.token_ids or chunk.finished:
            client.abort(rid)
            break
    # the ranks still agree afterwards: a fresh request is exactly transformers' greedy
    out = tp2.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 16})
    assert out["output_ids"] == hf_greedy(hf, PROMPT, 16)
    client.check_accounting()


# ---- lifecycle: shutdown, a dead rank, several nodes ----

def test_close_leaves_no_rank_behind(tiny_llama):
    eng = engine(tiny_llama[1], 2)
    pids = rank_pids(eng)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    eng.close()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_dead_rank_brings_the_engine_down_with_the_reason(tiny_llama):
    eng = engine(tiny_llama[1], 2)
    try:
        rid = eng.client.submit(input_ids=PROMPT, params={"max_new_tokens": 200,
                                                          "temperature": 0, "ignore_eos": True})
        os.kill(eng.client.ranks[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while eng.failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        reason = eng.failure()
        assert reason is not None and "rank" in reason, reason
        with pytest.raises(RuntimeError):  # the request ends with an error, it does not hang
            for _ in eng.client.stream(rid, timeout=30):
                pass
    finally:
        pids = rank_pids(eng)
        eng.close()
    assert not any(alive(p) for p in pids)


def test_two_nodes_on_loopback(tiny_llama):
    hf, path = tiny_llama
    addr = f"127.0.0.1:{free_loopback_port()}"
    flags = ["--model-path", str(path), "--tp-size", "2", "--nnodes", "2",
             "--dist-init-addr", addr, "--device", "cpu", "--dtype", "float32"]
    node1 = subprocess.Popen([sys.executable, "-m", "core.cli", "serve", *flags,
                              "--node-rank", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        with core.Engine(str(path), dtype="float32", max_total_tokens=512, tp_size=2,
                         nnodes=2, node_rank=0, dist_init_addr=addr, device="cpu") as eng:
            assert eng.client.ranks == []  # rank 1 is node 1's
            out = eng.generate(input_ids=PROMPT, sampling_params={**GREEDY,
                                                                  "max_new_tokens": 24})
        assert out["output_ids"] == hf_greedy(hf, PROMPT, 24)
        rc = node1.wait(timeout=30)
    finally:
        if node1.poll() is None:
            node1.kill()
        log = node1.communicate(timeout=10)[0]
    assert rc == 0, log  # node 0's shutdown reached node 1's rank
    assert "node 1 of 2: 1 rank(s) joining" in log


def start_serve(path: Path | str, port: int, *flags: str
                ) -> tuple[subprocess.Popen, list[str]]:
    """`core serve` on the CPU with `flags` (two engine processes or more: ranks or replicas),
    once listening; (process, its child pids)."""
    proc = subprocess.Popen([sys.executable, "-m", "core.cli", "serve", "--model-path",
                             str(path), "--device", "cpu", "--port", str(port),
                             "--served-model-name", "tiny", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "listening on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError("the server exited during start-up")
        assert "listening on" in line
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) >= 2  # rank 0 (the worker) and rank 1, or a worker per replica
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, children


def serve_tp2(path: Path, port: int) -> tuple[subprocess.Popen, list[str]]:
    return start_serve(path, port, "--tp-size", "2", "--max-total-tokens", "512")


def test_core_serve_tp2_answers_and_sigterm_leaves_nothing(tiny_llama):
    _, path = tiny_llama
    port = free_loopback_port()
    proc, children = serve_tp2(path, port)
    try:
        body = b'{"model": "tiny", "prompt": [256, 72, 101], "max_tokens": 8, "temperature": 0}'
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200 and b'"completion_tokens":8' in resp.read().replace(
                b" ", b"")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(int(p)) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(int(p)) for p in children)


def test_a_killed_server_leaves_no_rank_behind(tiny_llama):
    """SIGKILL: no shutdown message; rank 0 finds itself orphaned and stops rank 1 too."""
    _, path = tiny_llama
    proc, children = serve_tp2(path, free_loopback_port())
    try:
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 20
    while any(alive(int(p)) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(int(p)) for p in children)
