"""Decode under CUDA graphs (issue 6): the capture bookkeeping and the eager fallback on any
machine; real capture and replay on a GPU (`-m gpu`).

On the CPU the replay is played by a stand-in that reruns the captured function on the same static
buffers (what a CUDA graph replays), so padding, the slot-0 sink and the table writes are checked
against the eager decode here; only the capture itself needs CUDA.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the triton backend is imported

from conformance.model_configs import llama_config  # noqa: E402
from core.contract.attention import AttentionBackend  # noqa: E402
from core.contract.platform import GraphSupport  # noqa: E402
from core.engine.graphs import (  # noqa: E402
    GraphDecision,
    GraphRunner,
    capture_graphs,
    decide,
    graph_batch_sizes,
    graph_memory_reserve,
    padded_inputs,
    pick_bucket,
)
from core.plan.args import ServerArgs  # noqa: E402
from plugins.hardware.gpu import default_graph_max_bs as default_max_bs  # noqa: E402

GB = 10**9


ON, NO_GRAPHS = GraphSupport(True), GraphSupport(False, "device type cpu has no decode graphs")


# -- bookkeeping -----------------------------------------------------------------------------------

def test_buckets_are_powers_of_two_then_steps_of_eight_up_to_max_bs():
    assert graph_batch_sizes(160)[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(160)[-1] == 160 and len(graph_batch_sizes(160)) == 23
    assert graph_batch_sizes(100)[-2:] == [96, 100]  # the user's max is always captured
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        graph_batch_sizes(0)


def test_a_batch_pads_up_to_the_smallest_bucket_and_big_batches_have_none():
    sizes = graph_batch_sizes(40)
    assert [pick_bucket(b, sizes) for b in (1, 3, 5, 8, 9, 17, 40)] == [1, 4, 8, 8, 16, 24, 40]
    assert pick_bucket(41, sizes) is None
    with pytest.raises(ValueError, match="batch size"):
        pick_bucket(0, sizes)


def test_padding_rows_decode_token_zero_into_the_sink_slot_of_row_zero():
    rows = padded_inputs([5, 7], [11, 12], [30, 2], [901, 77], 4)
    assert rows == [[11, 12, 0, 0], [30, 2, 0, 0], [901, 77, 0, 0], [5, 7, 0, 0]]
    # a hybrid KV pool: each windowed group's new slots, padded with its sink slot 0
    hybrid = padded_inputs([5, 7], [11, 12], [30, 2], [901, 77], 4, [[3, 9], [40, 41]])
    assert hybrid == [*rows, [3, 9, 0, 0], [40, 41, 0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        padded_inputs([1, 2, 3], [0] * 3, [0] * 3, [1] * 3, 2)


def test_default_max_bs_follows_device_memory():
    assert default_max_bs(150_109_880_320) == 256  # H200: graphs for every decode slot
    assert default_max_bs(120 * GB) == 256
    assert default_max_bs(80 * GB) == 160  # H100 / A100-80G
    assert default_max_bs(48 * GB) == 96
    assert default_max_bs(24 * GB) == 48
    assert default_max_bs(8 * GB) == 24
    with pytest.raises(ValueError):
        default_max_bs(-1)


def test_graph_memory_reserve_grows_with_batch_and_vocab_and_stays_modest_for_8b():
    llama8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, dtype_bytes=2)
    r160 = graph_memory_reserve(160, **llama8b)
    assert graph_memory_reserve(8, **llama8b) < r160 < 2 * 2**30
    assert r160 < graph_memory_reserve(160, **{**llama8b, "vocab_size": 256000})


def test_decide_honours_the_plan_device_and_max_bs():
    off = decide(False, ON, None, 160, 256)
    assert not off.enabled and "graph capture off" in off.note
    cpu = decide(True, NO_GRAPHS, None, 0, 256)
    assert not cpu.enabled and "cpu" in cpu.note
    on = decide(True, ON, None, default_max_bs(141 * GB), 256)
    assert on.enabled and on.max_bs == 256 and on.sizes[0] == 1 and "256" in on.note
    h100 = decide(True, ON, None, default_max_bs(80 * GB), 256)
    assert h100.max_bs == 160 and h100.sizes[-1] == 160
    user = decide(True, ON, 12, 160, 256)
    assert user.sizes == (1, 2, 4, 8, 12) and "--cuda-graph-max-bs" in user.note
    capped = decide(True, ON, None, 160, 32)
    assert capped.max_bs == 32 and "max_running_requests" in capped.note
    none = decide(True, ON, None, 0, 32)
    assert not none.enabled and "no batch size" in none.note


def test_a_decode_backend_without_graphs_turns_them_off_in_the_plan(model_spec, test_registry):
    """Graph safety is the caps' (AttentionCaps.cuda_graph), checked once, by the resolver."""
    from core.plan.devices import PROFILES
    from core.plan.resolver import resolve

    plan = resolve(model_spec("llama-3.1-8b"), PROFILES["h200"],
                   ServerArgs(attention_backend="torch_native"), test_registry)
    assert plan.decode_attention == "torch_native" and not plan.cuda_graph
    assert any("decode attention torch_native cannot be captured" in n for n in plan.notes)
    assert not decide(plan.cuda_graph, ON, None, 160, 256).enabled


def test_disable_cuda_graph_reaches_the_engine_as_a_note(model_spec, test_registry):
    from core.plan.devices import PROFILES
    from core.plan.resolver import resolve

    spec = model_spec("llama-3.1-8b")
    on = resolve(spec, PROFILES["h200"], ServerArgs(), test_registry)
    off = resolve(spec, PROFILES["h200"], ServerArgs(disable_cuda_graph=True), test_registry)
    assert on.cuda_graph and not off.cuda_graph
    assert "graph capture off: --disable-cuda-graph" in off.notes
    assert not decide(off.cuda_graph, ON, None, 160, 256).enabled


def test_backend_graph_hooks_are_optional_and_graph_safety_is_declared_in_caps():
    from core.plan.registry import build_registry

    class _Plain:
        pass

    assert not hasattr(AttentionBackend, "supports_graph")  # declared once: the caps
    with pytest.raises(NotImplementedError, match="cannot be captured"):
        AttentionBackend.prepare_for_graph(_Plain(), None, 1)
    attn = build_registry().kind("attention")
    assert attn["triton"].caps.cuda_graph and not attn["torch_native"].caps.cuda_graph


def test_a_disabled_decision_captures_nothing_and_returns_its_note():
    class Runner:
        graph_runner = None

    runner = Runner()
    note = capture_graphs(runner, GraphDecision(False, (), "graph capture off: test"), 10, None)
    assert note == "graph capture off: test" and runner.graph_runner is None


# -- padded replay against eager decode (CPU stand-in for the graph) -------------------------------

def _stand_in_capture(gr: GraphRunner) -> None:
    """What capture records, replayed by rerunning it on the same static buffers."""

    class Replay:
        def __init__(self, batch, bs):
            self.batch, self.bs = batch, bs

        def replay(self):
            gr._forward(self.batch, self.bs)

    gr.prepare_capture()
    for bs in gr.sizes:
        batch = gr.capture_batch(bs)  # every KV group's view with its graph metadata
        gr._forward(batch, bs)  # the capture's own forward (CUDA warms up and records one)
        gr.graphs[bs] = Replay(batch, bs)


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    pytest.importorskip("triton")
    from model_fixtures import cpu_plan, torch_native_backend, write_tiny_llama

    from core.contract.attention import BackendContext
    from core.engine.loader import load_model
    from core.engine.memory.kv_cache import KVPool
    from core.engine.memory.memory_pool import ReqToTokenPool
    from core.engine.model_runner import ModelRunner
    from core.plan.args import make_server_args
    from core.plan.registry import build_registry
    from plugins.attention.triton.backend import TritonAttention

    # head_dim 32 (triton's smallest), 2 layers, GQA 4:2
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=128, head_dim=32)
    loaded = load_model(make_server_args(model_path=str(path)), cpu_plan("llama", page_size=1),
                        build_registry())
    cfg = loaded.hf_config
    ctx = BackendContext(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2,
                         dtype=torch.float32, kv_dtype=torch.float32, device=torch.device("cpu"),
                         page_size=1, max_context_len=cfg.max_position_embeddings)
    pool = KVPool(512, 2, 2, 32, torch.float32, "cpu")
    table = ReqToTokenPool(8, cfg.max_position_embeddings, "cpu")
    runner = ModelRunner(loaded.model, pool, table, torch_native_backend(cfg, page_size=1),
                         TritonAttention(ctx), "cpu")
    return runner, int(cfg.vocab_size)


def _prefill(runner, rows, lens, seed=0):
    rng = random.Random(seed)
    slots, base = {}, 1  # slot 0 is the sink
    tokens = [[rng.randrange(0, 250) for _ in range(n)] for n in lens]
    for r, n in zip(rows, lens, strict=True):
        slots[r] = list(range(base, base + n + 4))  # room for 4 decoded tokens
        base += n + 4
    runner.extend(rows, [0] * len(rows), tokens, [slots[r][:n] for r, n in zip(rows, lens,
                                                                                  strict=True)],
                  [])
    return slots


def _kv_snapshot(runner):
    """A function that puts the runner's KV pool and request table back as they are now."""
    pool, table = runner.kv_pool, runner.req_to_token.req_to_token
    saved = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers, table)]

    def restore():
        for dst, src in zip((*pool.k_buffers, *pool.v_buffers, table), saved, strict=True):
            dst.copy_(src)

    return restore


def test_padded_replay_matches_eager_decode_and_big_batches_stay_eager(tiny_runner):
    runner, vocab = tiny_runner
    rows, lens = [0, 2, 3, 5, 6], [5, 9, 3, 12, 7]
    slots = _prefill(runner, rows, lens)
    pool, table = runner.kv_pool, runner.req_to_token.req_to_token
    restore = _kv_snapshot(runner)

    def step(n):  # decode the first n requests once (input token 1 each)
        return runner.decode(rows[:n], [1] * n, lens[:n], [slots[r][lens[i]]
                                                           for i, r in enumerate(rows[:n])])

    eager3 = step(3).clone()
    table_after = table.clone()
    eager5 = step(5).clone()
    restore()

    gr = GraphRunner(runner.model, runner.decode_backend, pool, runner.req_to_token,
                     torch.device("cpu"), [1, 2, 4], vocab)
    _stand_in_capture(gr)
    runner.graph_runner = gr
    try:
        pool.k_buffers[0][0].zero_()
        graph3 = step(3)  # bucket 4: one padded row
        assert gr.replays == 1 and graph3.shape == (3, vocab)
        torch.testing.assert_close(graph3, eager3, atol=1e-4, rtol=1e-4)
        # real rows' new slots went into the table; the padded row wrote only into slot 0
        assert torch.equal(table, table_after)
        assert pool.k_buffers[0][0].abs().sum() > 0
        restore()
        big = step(5)  # above the largest bucket: eager, no replay
        assert gr.replays == 1
        torch.testing.assert_close(big, eager5)
    finally:
        runner.graph_runner = None
        restore()


def test_verify_steps_replay_the_graphs_as_decode_rows_and_match_the_extend(tiny_runner):
    """A speculative verify step (each request's last token and its drafts) with verify_graphs:
    one replay whose rows are the verified tokens at their own positions (triton's decode,
    interpreted) gives the extend's logits at every position and the same table; a step with
    more rows than the largest bucket runs as the extend."""
    runner, vocab = tiny_runner
    rows, lens = [1, 4, 7], [6, 11, 3]
    slots = _prefill(runner, rows, lens, seed=5)  # room for 4 more tokens each
    tokens = [[5, 17, 3, 99], [42, 8, 1], [60, 2, 33]]
    new = [slots[r][n:n + len(t)] for r, n, t in zip(rows, lens, tokens, strict=True)]
    pool, table = runner.kv_pool, runner.req_to_token.req_to_token
    restore = _kv_snapshot(runner)

    def verify(n):  # the first n requests
        return runner.verify(rows[:n], lens[:n], tokens[:n], new[:n]).clone()

    extend2, table2 = verify(2), table.clone()
    restore()
    extend3 = verify(3)
    restore()
    gr = GraphRunner(runner.model, runner.decode_backend, pool, runner.req_to_token,
                     torch.device("cpu"), [2, 8], vocab)
    _stand_in_capture(gr)
    runner.graph_runner, runner.verify_graphs = gr, True
    before = dict(runner.forward_count)
    try:
        rows2 = verify(2)  # 7 rows: bucket 8
        assert gr.replays == 1 and rows2.shape == (7, vocab)
        torch.testing.assert_close(rows2, extend2, atol=1e-4, rtol=1e-4)
        assert torch.equal(table, table2)
        restore()
        torch.testing.assert_close(verify(3), extend3)  # 10 rows: the extend
        assert gr.replays == 1
        assert runner.forward_count["verify_graph"] - before.get("verify_graph", 0) == 1
        assert runner.forward_count["decode"] == before["decode"]
    finally:
        runner.graph_runner, runner.verify_graphs = None, False
        restore()


# -- a hybrid KV pool under graphs (CPU stand-in) --------------------------------------------------

class _StandInRunner(GraphRunner):
    """A platform's graph runner whose capture is the CPU stand-in."""

    def capture(self) -> None:
        _stand_in_capture(self)


class _StandInPlatform:
    def __init__(self, runner_cls=_StandInRunner, groups=True):
        self.runner_cls, self.groups = runner_cls, groups

    def graph_runner(self, runner, sizes, vocab_size):
        if self.groups:
            return self.runner_cls.for_runner(runner, sizes, vocab_size)
        # a platform that builds its runner as before hybrid pools: group 0 only
        return self.runner_cls(runner.model, runner.decode_backend, runner.kv_pool,
                               runner.req_to_token, runner.device, sizes, vocab_size)


HYBRID_PROMPTS = (43, 9, 3, 16, 17)  # the window is 8 tokens: 5x, 1x, under it, ...
HYBRID_NEW = (20, 14, 12, 4, 15)  # five requests (eager), then 4, 3 (padded to 4), 2, 1


def _hybrid_core(path):
    """An in-process engine core over a hybrid pool (pages of 4, windowed groups a quarter of
    the full one) whose decode backends are triton's (interpreted here), as on a GPU."""
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args
    from plugins.attention.triton.backend import TritonAttention

    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(path), dtype="float32", max_total_tokens=512, page_size=4,
        chunked_prefill_size=16, swa_full_tokens_ratio=0.25,
        disable_cuda_graph=True))  # its decode backends are swapped below: no CPU graphs of them
    core_ = build_engine_core(args, plan, spec, registry)
    assert any(n.startswith("hybrid KV pool (") for n in core_.info.notes), core_.info.notes
    runner = core_.scheduler.runner
    ctx = runner.decode_backend.ctx
    runner.decode_backend = TritonAttention(ctx)
    runner.group_backends = [(pre, TritonAttention(ctx)) for pre, _ in runner.group_backends]
    return core_


def _hybrid_generate(core_, check):
    """Greedy generation of the HYBRID_* requests; every decode is logged by `check(rows,
    logits)` (called after it) and the page accounting is checked after every step."""
    sched = core_.scheduler
    runner = sched.runner
    inner = runner.decode

    def decode(rows, *a, **kw):
        check.before(rows)
        logits = inner(rows, *a, **kw)
        check.after(rows, logits)
        return logits

    runner.decode = decode
    gen = torch.Generator().manual_seed(3)
    for i, (n, new) in enumerate(zip(HYBRID_PROMPTS, HYBRID_NEW, strict=True)):
        sched.add_request(f"r{i}", torch.randint(0, 256, (n,), generator=gen).tolist(),
                          {"temperature": 0, "ignore_eos": True, "max_new_tokens": new})
    out: dict[str, list[int]] = {}
    while sched.has_work:
        for r in sched.step():
            out.setdefault(r.rid, []).extend(r.pending_ids)
            r.pending_ids.clear()
        sched.check_accounting()
    sched.cache.evict(sched.allocator.total_pages)
    sched.check_accounting()
    st = sched.stats()
    assert st["free_pages"] == st["total_pages"]
    assert st["kv_group1_free_pages"] == st["kv_group1_total_pages"]
    return out


class _DecodeLog:
    """Each decode's batch size, logits and every group's table after it; the pools' sink slot
    0 is zeroed before each decode and whether a padded row wrote it in every group noted."""

    def __init__(self, runner, sched):
        self.runner, self.sched = runner, sched
        self.pools = [runner.kv_pool, *runner.group_pools]
        self.steps: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
        self.sink_written: list[bool] = []
        self.dummy_in_table: list[bool] = []
        self.replayed: list[bool] = []

    def before(self, rows):
        for pool in self.pools:
            for i in pool.layers:
                pool.v_buffers[i][0].zero_()
        gr = self.runner.graph_runner
        self._replays = gr.replays if gr is not None else 0
        # a windowed group's freed pages in a running request's page list (its table points at
        # the dummy page there): pages were given back before this step
        dummies = [a.dummy_page for a in self.sched.pages.group_allocators]
        self.dummy_in_table.append(any(d in w for r in self.sched.q.running
                                       for d, w in zip(dummies, r.wpages, strict=True)))

    def after(self, rows, logits):
        gr = self.runner.graph_runner
        self.replayed.append(gr is not None and gr.replays > self._replays)
        self.sink_written.append(all(bool(pool.v_buffers[i][0].abs().sum() > 0)
                                     for pool in self.pools for i in pool.layers))
        self.steps.append((len(rows), logits.clone(),
                           [t.clone() for t in self.runner.req_to_token.tables]))


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_hybrid_pool_replays_match_eager_decode(arch, tmp_path):
    """A windowed model over a hybrid KV pool (Gemma 2: soft-caps, GPT-OSS: sinks; window 8,
    prompts and generations past it, so windowed pages are given back between replays), triton
    decode, greedy: with the stand-in graphs of buckets 1, 2, 4 (captured through
    capture_graphs and the platform's runner) every decode step's logits equal the eager
    hybrid decode's within fp32 rounding, the tokens are the same, every group's table is the
    same after each step, padded rows (3 requests in a bucket of 4) write only each group's
    sink slot 0, batches of 5 run eagerly, and the pages of every group add up after every
    step."""
    pytest.importorskip("triton")
    from model_fixtures import write_tiny_model

    path = write_tiny_model(arch, tmp_path / arch, head_dim=32)  # triton's smallest head
    eager_core = _hybrid_core(path)
    sched = eager_core.scheduler
    eager = _DecodeLog(sched.runner, sched)
    want = _hybrid_generate(eager_core, eager)

    graph_core = _hybrid_core(path)
    sched = graph_core.scheduler
    runner = sched.runner
    vocab = int(graph_core.info.vocab_size)
    note = capture_graphs(runner, GraphDecision(True, (1, 2, 4), "test"), vocab,
                          _StandInPlatform())
    assert note.startswith("captured decode graphs"), note
    gr = runner.graph_runner
    assert gr.num_groups == runner.num_groups == 2 and gr.packed.shape[0] == 5
    # the windowed group's decode splits are sized for its window, the full group's for the
    # whole context (any count is correct; a larger one only launches more programs)
    window = runner.group_windows[0]
    assert window is not None and gr.group_windows == [window]
    assert runner.group_backends[0][1]._graph_context == window + 1
    assert runner.decode_backend._graph_context == runner.req_to_token.max_context
    graphs = _DecodeLog(runner, sched)
    got = _hybrid_generate(graph_core, graphs)

    assert got == want
    assert len(graphs.steps) == len(eager.steps)
    for i, ((b, lg, tables), (b0, lg0, tables0)) in enumerate(zip(graphs.steps, eager.steps,
                                                                    strict=True)):
        assert b == b0, i
        torch.testing.assert_close(lg, lg0, atol=1e-4, rtol=1e-4, msg=f"decode step {i}")
        for g, (t, t0) in enumerate(zip(tables, tables0, strict=True)):
            assert torch.equal(t, t0), (i, g)
    sizes = [b for b, _, _ in graphs.steps]
    assert graphs.replayed == [b <= 4 for b in sizes] and 5 in sizes and gr.replays > 0
    # padded replays wrote the sink of every group; unpadded ones and eager steps wrote none
    padded = [r and b not in (1, 2, 4) for r, b in zip(graphs.replayed, sizes, strict=True)]
    assert 3 in sizes and graphs.sink_written == padded
    assert not any(eager.sink_written)
    # windowed pages were given back while graphs replayed
    assert any(r and d for r, d in zip(graphs.replayed, graphs.dummy_in_table, strict=True))


def test_a_platform_runner_without_the_pools_groups_leaves_decode_eager(tmp_path):
    """A platform whose graph runner was built without a hybrid pool's groups (group 0's pool,
    backend and table alone): capture_graphs gets the refusal and says so, and decode stays
    eager (never a replay that would read group 0's table in every layer)."""
    pytest.importorskip("triton")
    from model_fixtures import write_tiny_model

    core_ = _hybrid_core(write_tiny_model("gemma2", tmp_path / "g2", head_dim=32))
    runner = core_.scheduler.runner
    note = capture_graphs(runner, GraphDecision(True, (1, 2), "test"), 260,
                          _StandInPlatform(groups=False))
    assert "capture failed" in note and "KV pool of 2 group(s)" in note, note
    assert runner.graph_runner is None


# -- real capture on a GPU -------------------------------------------------------------------------

LLAMA_SMALL = llama_config(  # Llama-3 layer shapes (8 heads of 128, GQA 4:1), few layers: quick
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192, rope_scaling=None,
    bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from model_fixtures import write_config_model

    return write_config_model(tmp_path_factory.mktemp("llama_small"), LLAMA_SMALL)


def _gpu_run(model_dir: str, dtype: str, **kw):
    from core import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(300, 30000) for _ in range(n)]
               for n in (7, 33, 130, 511, 64, 9, 200, 17, 90, 45)]
    # Different lengths: the batch shrinks through buckets 8, 4, 2, 1; ten requests start
    # above the largest bucket (8), so the first steps run eagerly.
    news = [64, 40, 20, 64, 10, 33, 5, 50, 12, 3]
    with Engine(model_dir, load_format="dummy", device="cuda", dtype=dtype,
                max_total_tokens=16384, **kw) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in news])
        stats = engine.stats()
        info = engine.info
    return [o["output_ids"] for o in outs], stats, info


@pytest.mark.gpu
def test_greedy_with_graphs_equals_without_on_cuda(gpu_model_dir):
    with_graphs, stats, info = _gpu_run(gpu_model_dir, "float32", cuda_graph_max_bs=8)
    assert info.cuda_graph_batch_sizes == (1, 2, 4, 8)
    assert any(n.startswith("captured decode graphs") for n in info.notes)
    assert stats["graph_replays"] > 0
    assert stats["graph_replays"] < stats["forward_count"]["decode"]  # the bs-10 steps: eager
    without, stats_off, info_off = _gpu_run(gpu_model_dir, "float32", disable_cuda_graph=True)
    assert not info_off.cuda_graph_batch_sizes and stats_off["graph_replays"] == 0
    assert any("graph capture off" in n for n in info_off.notes)
    assert with_graphs == without


@pytest.mark.gpu
def test_bf16_graph_replays_match_eager_decode_logits(gpu_model_dir):
    """bf16: greedy tokens of a random-weight model may flip at a near-tie between graph and
    eager runs (the padded batch and the graphs' fixed KV split count round differently), so
    the comparison is teacher-forced: the same decode inputs, step by step, from the same KV
    state, eager and replayed; logits agree to bf16 rounding and the argmax wherever the top
    two are apart by more than that."""
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    args, plan, spec, registry = make_plan(make_server_args(
        model_path=gpu_model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
        max_total_tokens=16384, cuda_graph_max_bs=8))
    runner = build_engine_core(args, plan, spec, registry).scheduler.runner
    gr = runner.graph_runner
    assert gr is not None and gr.sizes == [1, 2, 4, 8]
    rng = random.Random(1)
    rows, lens = [0, 1, 2], [7, 130, 33]  # bucket 4: one padded row
    base, slots = 64, []
    for n in lens:
        slots.append(list(range(base, base + n + 8)))
        base += n + 8
    runner.extend(rows, [0] * 3, [[rng.randrange(300, 30000) for _ in range(n)] for n in lens],
                  [sl[:n] for sl, n in zip(slots, lens, strict=True)], [])
    restore = _kv_snapshot(runner)
    inputs = [[rng.randrange(300, 30000) for _ in rows] for _ in range(6)]

    def decode_all():
        out = []
        for step, ids in enumerate(inputs):
            pos = [n + step for n in lens]
            out.append(runner.decode(rows, ids, pos, [sl[p] for sl, p in zip(slots, pos,
                                                                                strict=True)])
                       .float().clone())
        restore()
        return out

    runner.graph_runner = None
    eager = decode_all()
    runner.graph_runner = gr
    replays = gr.replays
    graphs = decode_all()
    assert gr.replays == replays + len(inputs)
    for step, (g, e) in enumerate(zip(graphs, eager, strict=True)):
        scale = e.abs().max().item()
        torch.testing.assert_close(g, e, atol=0.02 * scale, rtol=0.02,
                                   msg=lambda m, s=step: f"decode step {s}: {m}")
        top2 = e.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.04 * scale
        assert torch.equal(g.argmax(-1)[clear], e.argmax(-1)[clear]), step


def test_lora_plans_replay_graphs_for_base_only_steps(tiny_runner, tmp_path):
    """Graphs captured without the LoRA path (a graph runner built without the manager; what a
    backend that is not graph safe gets, tests/test_lora_graphs.py): a decode step of base
    requests alone replays the graph and matches eager; a step serving an adapter runs eagerly
    with its delta (the graphs hold none), and a base step after it replays without that
    adapter's delta."""
    from model_fixtures import write_config_adapter

    from core.contract.lora import BASE_SLOT, LoRAConfig
    from core.engine.lora import LoRAManager
    from core.layers.linear import Linear, reset_bindings
    from plugins.lora.torch_native.backend import TorchNativeLoRA

    runner, vocab = tiny_runner
    model = runner.model
    cfg = type("Cfg", (), {})()
    lin = model.model.layers[0]
    cfg.hidden_size, cfg.num_hidden_layers = 128, len(model.model.layers)
    cfg.intermediate_size = lin.mlp.down_proj.input_size
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    adapter = write_config_adapter(tmp_path / "a", cfg, 8, 64, 5, torch.float32)
    cpu = torch.device("cpu")
    lora = LoRAManager(model, TorchNativeLoRA(LoRAConfig(1, 8, torch.float32, cpu)), 1, 8,
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"}, torch.float32, cpu)
    slot = lora.acquire(lora.lookup(lora.load("a", str(adapter)).name))
    rows, lens = [0, 2, 3], [5, 9, 3]
    runner.lora = lora
    try:
        slots = _prefill(runner, rows, lens, seed=1)
        restore = _kv_snapshot(runner)

        def step(which):
            return runner.decode(rows, [1] * 3, lens, [slots[r][lens[i]]
                                                       for i, r in enumerate(rows)],
                                 lora=which).clone()

        base_eager = step([BASE_SLOT] * 3)
        restore()
        tuned_eager = step([slot, BASE_SLOT, BASE_SLOT])
        restore()
        assert not torch.allclose(tuned_eager[0], base_eager[0], atol=1e-3)
        torch.testing.assert_close(tuned_eager[1:], base_eager[1:])
        gr = GraphRunner(model, runner.decode_backend, runner.kv_pool, runner.req_to_token, cpu,
                         [1, 2, 4], vocab)
        _stand_in_capture(gr)
        runner.graph_runner = gr
        torch.testing.assert_close(step([BASE_SLOT] * 3), base_eager, atol=1e-4, rtol=1e-4)
        assert gr.replays == 1
        restore()
        torch.testing.assert_close(step([slot, BASE_SLOT, BASE_SLOT]), tuned_eager)
        assert gr.replays == 1  # eager: the graphs hold no delta
        restore()
        torch.testing.assert_close(step([BASE_SLOT] * 3), base_eager, atol=1e-4, rtol=1e-4)
        assert gr.replays == 2  # ... and the adapter's step left nothing behind
    finally:
        runner.graph_runner = None
        runner.lora = None
        for module in model.modules():
            if isinstance(module, Linear):
                module.epilogue = None
        reset_bindings(model)


# -- a hybrid KV pool under real graphs ------------------------------------------------------------

def _hybrid_gpu_run(path: str, prompts, news, **kw):
    """Greedy generation on CUDA over a hybrid pool (windowed groups a quarter of the full
    one); -> (token lists, stats, info). The accounting of every group is checked at the end."""
    from core import Engine

    with Engine(path, device="cuda", swa_full_tokens_ratio=0.25, **kw) as engine:
        notes = engine.info.notes
        assert any(n.startswith("hybrid KV pool (") for n in notes), notes
        assert not any("hybrid KV pool off" in n for n in notes), notes
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in news])
        stats = engine.stats()
        engine.check_accounting()
        info, plan = engine.info, engine.plan
    assert plan.decode_attention == "triton"
    assert 0 < stats["kv_group1_total_pages"] < stats["total_pages"]
    return [o["output_ids"] for o in outs], stats, info


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt_oss"])
def test_hybrid_pool_graphs_equal_eager_and_hf_on_cuda(arch, tmp_path):
    """Tiny windowed models (window 8, head dim 32 so that triton decodes), fp32, pages of 4:
    five requests past the window (eager while five run, then buckets 4 with a padded row, 2,
    1) give the same tokens with graphs over the hybrid pool as without graphs, and as
    transformers' greedy generation on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from hf_compare import hf_greedy
    from model_fixtures import tiny_hf_model, write_tiny_model

    path = str(write_tiny_model(arch, tmp_path / arch, head_dim=32))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in HYBRID_PROMPTS]
    kw = dict(dtype="float32", max_total_tokens=512, page_size=4, chunked_prefill_size=16)
    with_graphs, stats, info = _hybrid_gpu_run(path, prompts, HYBRID_NEW, cuda_graph_max_bs=4,
                                               **kw)
    assert info.cuda_graph_batch_sizes == (1, 2, 4)
    assert any(n.startswith("captured decode graphs") for n in info.notes)
    assert 0 < stats["graph_replays"] < stats["forward_count"]["decode"]
    without, stats_off, _ = _hybrid_gpu_run(path, prompts, HYBRID_NEW, disable_cuda_graph=True,
                                            **kw)
    assert stats_off["graph_replays"] == 0
    assert with_graphs == without
    hf = tiny_hf_model(arch, head_dim=32)
    assert with_graphs == [hf_greedy(hf, p, n) for p, n in zip(prompts, HYBRID_NEW,
                                                                 strict=True)]


def _windowed_config(name: str, layers: int, window: int) -> dict:
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parent / "fixtures" / "configs" / f"{name}.json")
                     .read_text())
    cfg.update(num_hidden_layers=layers, sliding_window=window)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "sliding_window_size" in cfg:
        cfg["sliding_window_size"] = window
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "dtype"), [("gemma-2-9b", "bfloat16"),
                                             ("gpt-oss-20b-bf16", "float32")])
def test_hybrid_pool_graphs_at_real_shapes_on_cuda(name, dtype, tmp_path):
    """Gemma-2-9B's and GPT-OSS-20B's layer shapes (head dims 256 and 64, soft-caps, sinks),
    4 layers, a 128-token window, dummy weights, the platform's page size: prompts past the
    window decoded past it again, with graphs over the hybrid pool and without. bf16 for Gemma
    2 (a different batch shape can flip a near-tie, as in the bf16 test above), fp32 for
    GPT-OSS (its random routers sit near ties in bf16): the first tokens and most of the rest
    agree."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from model_fixtures import write_config_model

    path = write_config_model(tmp_path / name, _windowed_config(name, 4, 128))
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 30000) for _ in range(n)] for n in (700, 300, 200, 150, 40)]
    news = [160, 140, 120, 10, 130]
    kw = dict(load_format="dummy", dtype=dtype, max_total_tokens=8192, context_length=4096,
              chunked_prefill_size=512)  # windowed groups then a quarter of the full one
    with_graphs, stats, info = _hybrid_gpu_run(path, prompts, news, cuda_graph_max_bs=4, **kw)
    assert info.cuda_graph_batch_sizes == (1, 2, 4)
    assert 0 < stats["graph_replays"] < stats["forward_count"]["decode"]
    without, _, _ = _hybrid_gpu_run(path, prompts, news, disable_cuda_graph=True, **kw)
    assert all(a[:3] == b[:3] for a, b in zip(with_graphs, without, strict=True))
    same = sum(x == y for a, b in zip(with_graphs, without, strict=True)
               for x, y in zip(a, b, strict=True))
    assert same >= 0.8 * sum(news)
