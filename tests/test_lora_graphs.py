"""LoRA adapters inside decode graphs (issue 36): with a graph-safe LoRA backend (triton) the
decode graphs hold the LoRA path (core/contract/graphs.py), so steps serving adapters replay
them; with one that is not (torch_native) adapter steps stay eager.

On the CPU the graphs are the stand-in of tests/test_cuda_graph.py (a replay reruns the
captured forward on the same static buffers; triton under TRITON_INTERPRET=1, fp32): mixed
base / adapter batches, a padded bucket among them, equal eager LoRA decode step by step, and a
slot loaded with another adapter between replays is read by the next replay. On a GPU
(`-m gpu`) the same through real CUDA graph capture in core.Engine.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel is imported

from test_cuda_graph import _StandInPlatform  # noqa: E402 - the CPU stand-in for CUDA graphs

from core.contract.graphs import padded_inputs  # noqa: E402
from core.contract.lora import BASE_SLOT, LoRABatch  # noqa: E402
from core.engine.graphs import GraphDecision, capture_graphs  # noqa: E402

_IDS = itertools.count()
BUCKETS = (1, 2, 4)
# five requests (eager: above the largest bucket), then 4, 3 (padded to 4), 2, 1 as they end
LORAS = ("a", None, "b", "c", "a")
NEW = (8, 7, 5, 2, 6)  # distinct: the batch shrinks 5, 4, 3, 2, 1
RANKS = {"a": 8, "b": 16, "c": 4, "d": 8}  # --max-lora-rank 16
# c: attention only, so one adapter leaves the MLP projections' slots zero
C_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


# -- fixtures --------------------------------------------------------------------------------------

def _write_adapter(path, cfg, name, seed, targets=None):
    """A random PEFT adapter of rank RANKS[name] (scaling 4) on every projection, or on
    `targets` only."""
    import json

    from model_fixtures import write_config_adapter
    from safetensors.torch import load_file, save_file

    r = RANKS[name]
    write_config_adapter(path, cfg, r, 4 * r, seed, torch.float32)
    if targets is not None:
        file = os.path.join(path, "adapter_model.safetensors")
        kept = {k: v for k, v in load_file(file).items()
                if k.split(".lora_")[0].rsplit(".", 1)[-1] in targets}
        save_file(kept, file, metadata={"format": "pt"})
        conf = os.path.join(path, "adapter_config.json")
        with open(conf, encoding="utf-8") as fh:
            c = json.load(fh)
        c["target_modules"] = list(targets)
        with open(conf, "w", encoding="utf-8") as fh:
            json.dump(c, fh)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama (head dim 32: triton's smallest) and adapters a (rank 8), b (16), c (4,
    attention only), d (8, another seed: loaded later into a slot a held)."""
    pytest.importorskip("triton")
    from model_fixtures import tiny_config, write_tiny_model

    root = tmp_path_factory.mktemp("lora_graphs")
    model = write_tiny_model("llama", root / "model", head_dim=32)
    cfg = tiny_config("llama", head_dim=32)
    adapters = {"a": _write_adapter(root / "a", cfg, "a", 1),
                "b": _write_adapter(root / "b", cfg, "b", 2),
                "c": _write_adapter(root / "c", cfg, "c", 3, C_TARGETS),
                "d": _write_adapter(root / "d", cfg, "d", 4)}
    return str(model), adapters


def _core(model, adapters, lora_backend, slots=3, graphs=False):
    """An in-process engine core (fp32, pages of 4) serving `adapters` with triton decode
    attention (interpreted here, as on a GPU) and the LoRA backend `lora_backend` ("triton" or
    "torch_native"; the CPU's plan picks torch_native, so triton is put in its place); with
    `graphs`, stand-in decode graphs of BUCKETS captured through capture_graphs."""
    from core.contract.lora import LoRAConfig
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args
    from plugins.attention.triton.backend import TritonAttention

    args, plan, spec, registry = make_plan(make_server_args(
        model_path=model, dtype="float32", max_total_tokens=512, page_size=4,
        lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=slots,
        max_lora_rank=16))
    core_ = build_engine_core(args, plan, spec, registry)
    runner = core_.scheduler.runner
    runner.decode_backend = TritonAttention(runner.decode_backend.ctx)
    manager = runner.lora
    assert plan.lora_backend == "torch_native" and not manager.graph_safe
    if lora_backend == "triton":
        from plugins.lora.triton.backend import TritonLoRA

        manager.backend = TritonLoRA(LoRAConfig(slots, 16, torch.float32, runner.device))
        manager.graph_safe = True  # plugins/lora/triton declares graph_safe
    if graphs:
        note = capture_graphs(runner, GraphDecision(True, BUCKETS, "test"),
                              int(core_.info.vocab_size), _StandInPlatform())
        assert note.startswith("captured decode graphs"), note
        assert ("with the LoRA path" in note) == (lora_backend == "triton"), note
    return core_


class _DecodeLog:
    """Each decode step: batch size, LoRA slots, logits, and whether it replayed a graph."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[int, tuple[int, ...], torch.Tensor]] = []
        self.replayed: list[bool] = []
        inner = runner.decode

        def decode(rows, *a, lora=None, **kw):
            gr = runner.graph_runner
            before = gr.replays if gr is not None else 0
            logits = inner(rows, *a, lora=lora, **kw)
            self.replayed.append(gr is not None and gr.replays > before)
            self.steps.append((len(rows), tuple(lora or ()), logits.clone()))
            return logits

        runner.decode = decode


def _prompts(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in (7, 12, 5, 9, 16)[:n]]


def _generate(core_, prompts, loras, news):
    """Greedy generation (every step's accounting checked); -> tokens per request."""
    sched = core_.scheduler
    rids = []
    for p, lora, n in zip(prompts, loras, news, strict=True):
        rids.append(f"r{next(_IDS)}")
        sched.add_request(rids[-1], p, {"temperature": 0, "ignore_eos": True,
                                        "max_new_tokens": n}, lora=lora)
    out: dict[str, list[int]] = {}
    while sched.has_work:
        for r in sched.step():
            out.setdefault(r.rid, []).extend(r.pending_ids)
            r.pending_ids.clear()
        sched.check_accounting()
    return [out[rid] for rid in rids]


def _same_steps(got: _DecodeLog, want: _DecodeLog) -> None:
    assert len(got.steps) == len(want.steps)
    for i, ((b, lo, lg), (b0, lo0, lg0)) in enumerate(zip(got.steps, want.steps, strict=True)):
        assert (b, lo) == (b0, lo0), i
        torch.testing.assert_close(lg, lg0, atol=1e-4, rtol=1e-4, msg=f"decode step {i}")


# -- the packing and the contract ------------------------------------------------------------------

def test_the_lora_row_is_packed_last_and_padded_rows_are_the_base():
    rows = padded_inputs([5, 7, 2], [11, 12, 13], [30, 2, 8], [901, 77, 5], 4, [[3, 9, 4]],
                         lora=[1, BASE_SLOT, 0])
    assert rows[-1] == [1, BASE_SLOT, 0, BASE_SLOT]
    assert rows[:-1] == padded_inputs([5, 7, 2], [11, 12, 13], [30, 2, 8], [901, 77, 5], 4,
                                      [[3, 9, 4]])


def test_a_device_only_batch_has_no_host_slots_and_torch_native_refuses_it():
    from plugins.lora.torch_native.backend import TorchNativeLoRA

    slots = torch.tensor([0, -1, 2], dtype=torch.int32)
    batch = LoRABatch.on_device(torch.arange(4, dtype=torch.int32), slots)
    assert batch.device_only and batch.seg_lens == [1, 1, 1] and batch.num_tokens == 3
    for read in (lambda: list(batch.seg_slots), lambda: batch.ranks[0],
                 lambda: len(batch.seg_slots)):
        with pytest.raises(RuntimeError, match="not on the host"):
            read()
    with pytest.raises(RuntimeError, match="not on the host"):
        TorchNativeLoRA(None).prepare(batch)  # not graph safe: it reads the host lists


# -- stand-in graphs against eager decode ----------------------------------------------------------

@pytest.fixture(scope="module")
def eager_run(files):
    """The reference: eager decode with the triton LoRA backend (tokens, decode log)."""
    model, adapters = files
    core_ = _core(model, {n: adapters[n] for n in "abc"}, "triton")
    log = _DecodeLog(core_.scheduler.runner)
    return _generate(core_, _prompts(5), LORAS, NEW), log


def test_mixed_adapter_batches_replay_graphs_equal_to_eager(files, eager_run):
    """Requests under adapters a, b, c (ranks 8, 16, 4; c on attention only) and the base in
    one batch, triton LoRA, stand-in graphs of buckets 1, 2, 4 captured through capture_graphs:
    every step of 4 or fewer requests replays a graph, those with adapters included (3 requests
    padded into the bucket of 4 too), the batch of 5 runs eagerly, and every decode step's
    logits equal eager LoRA decode's within 1e-4, the tokens the same; the adapters change the
    tokens (the delta is in the replays)."""
    model, adapters = files
    want, eager = eager_run
    core_ = _core(model, {n: adapters[n] for n in "abc"}, "triton", graphs=True)
    runner = core_.scheduler.runner
    gr = runner.graph_runner
    assert gr.captures_lora and gr.packed.shape[0] == 5  # ids, positions, slots, rows, LoRA
    log = _DecodeLog(runner)
    got = _generate(core_, _prompts(5), LORAS, NEW)
    assert got == want
    _same_steps(log, eager)
    sizes = [b for b, _, _ in log.steps]
    assert log.replayed == [b <= 4 for b in sizes] and 5 in sizes and 3 in sizes
    with_adapters = [r for r, (_, lo, _) in zip(log.replayed, log.steps, strict=True)
                     if r and any(s != BASE_SLOT for s in lo)]
    assert len(with_adapters) >= 3  # buckets 4 (3 padded), 2, 1 under adapters
    assert runner.lora.batch is None  # no LoRA step left open after a replay
    # the same prompts on the base model alone: the adapters' tokens differ
    base = _generate(core_, _prompts(5), (None,) * 5, NEW)
    assert all(g != b for g, b, lora in zip(got, base, LORAS, strict=True) if lora)
    assert [g for g, lora in zip(got, LORAS, strict=True) if not lora] == \
        [b for b, lora in zip(base, LORAS, strict=True) if not lora]


@pytest.mark.slow  # ~55 s on 2 vCPUs; the mixed-batch replay test above stays in CI's set
def test_a_slot_reloaded_between_replays_is_read_by_the_next_replay(files):
    """One device slot: a serves three requests (padded into the bucket of 4) through graph
    replays; a is unloaded and d loaded, then b and d are served in turn, each copied into the
    same slot in place (the graphs' buffers, never rebound): every replay equals eager decode
    under the same sequence of loads, and d's tokens differ from a's on the same prompts."""
    model, adapters = files
    ad = {n: adapters[n] for n in "ab"}
    runs = {}
    for graphs in (False, True):
        core_ = _core(model, ad, "triton", slots=1, graphs=graphs)
        runner, manager = core_.scheduler.runner, core_.scheduler.runner.lora
        log = _DecodeLog(runner)
        buffers = [(p.weights.a.data_ptr(), p.weights.b.data_ptr(),
                    p.weights.scalings.data_ptr()) for p in manager.projections]
        toks = [_generate(core_, _prompts(3), ("a",) * 3, (4, 3, 2))]
        manager.unload("a")
        manager.load("d", adapters["d"])
        toks.append(_generate(core_, _prompts(3), ("b",) * 3, (4, 3, 2)))
        toks.append(_generate(core_, _prompts(3), ("d",) * 3, (4, 3, 2)))
        assert manager.loads == 3 and manager.slot_uid[0] == manager.lookup("d")
        assert buffers == [(p.weights.a.data_ptr(), p.weights.b.data_ptr(),
                            p.weights.scalings.data_ptr()) for p in manager.projections]
        runs[graphs] = toks, log
    (want, eager), (got, log) = runs[False], runs[True]
    assert got == want
    _same_steps(log, eager)
    assert all(log.replayed) and not any(eager.replayed)
    assert got[2] != got[0] and got[1] != got[0]


def test_torch_native_keeps_adapter_steps_eager(files, eager_run):
    """A LoRA backend that is not graph safe (torch_native): capture_graphs says the graphs hold
    no LoRA deltas, steps serving an adapter run eagerly, steps of base requests alone replay
    the graphs (captured with no LoRA step open), and the tokens equal the triton eager run's."""
    model, adapters = files
    want, _ = eager_run
    core_ = _core(model, {n: adapters[n] for n in "abc"}, "torch_native")
    runner = core_.scheduler.runner
    note = capture_graphs(runner, GraphDecision(True, BUCKETS, "test"),
                          int(core_.info.vocab_size), _StandInPlatform())
    assert "without LoRA deltas" in note and "run eagerly" in note, note
    gr = runner.graph_runner
    assert not gr.captures_lora and gr.packed.shape[0] == 4
    with pytest.raises(ValueError, match="hold no LoRA deltas"):
        gr.decode([0], [1], [3], [9], lora=[0])
    log = _DecodeLog(runner)
    # 4, 3, 2 requests under adapters and the base, then the base request alone
    news = (3, 7, 5, 2, 6)  # within NEW: eager_run's tokens are the reference
    got = _generate(core_, _prompts(5), LORAS, news)
    assert got == [w[:n] for w, n in zip(want, news, strict=True)]
    base_only = [all(s == BASE_SLOT for s in lo) for _, lo, _ in log.steps]
    sizes = [b for b, _, _ in log.steps]
    assert log.replayed == [b <= 4 and base for b, base in zip(sizes, base_only, strict=True)]
    assert any(log.replayed)
    assert any(b <= 4 and not base for b, base in zip(sizes, base_only, strict=True))


# -- real capture on a GPU -------------------------------------------------------------------------

def _gpu_files(tmp_path):
    from model_fixtures import tiny_config, write_tiny_model

    model = write_tiny_model("llama", tmp_path / "model", head_dim=32)
    cfg = tiny_config("llama", head_dim=32)
    return str(model), {n: _write_adapter(tmp_path / n, cfg, n, i + 1,
                                          C_TARGETS if n == "c" else None)
                        for i, n in enumerate("abcd")}


def _engine_run(model, adapters, steps, **kw):
    """core.Engine on CUDA: each of `steps` is ("generate", loras, news), ("load", name, path)
    or ("unload", name); -> (tokens of each generate, (decode steps, graph replays) of each,
    final stats, info, plan)."""
    from core import Engine

    out, counts = [], []
    with Engine(model, device="cuda", max_total_tokens=4096, max_lora_rank=16,
                lora_paths=[f"{n}={p}" for n, p in adapters.items()], **kw) as engine:
        for step in steps:
            if step[0] == "generate":
                _, loras, news = step
                before = engine.stats()
                outs = engine.generate(
                    input_ids=_prompts(len(loras)), lora_path=list(loras),
                    sampling_params=[{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                     for n in news])
                after = engine.stats()
                out.append([o["output_ids"] for o in outs])
                counts.append((after["forward_count"]["decode"]
                               - before["forward_count"]["decode"],
                               after["graph_replays"] - before["graph_replays"]))
            elif step[0] == "load":
                engine.load_lora_adapter(step[1], step[2])
            else:
                engine.unload_lora_adapter(step[1])
        stats, info, plan = engine.stats(), engine.info, engine.plan
    return out, counts, stats, info, plan


@pytest.mark.gpu
def test_lora_graphs_equal_eager_on_cuda(tmp_path):
    """Real capture, fp32, triton LoRA: mixed base / adapter batches (5 requests eager, then
    buckets 4 with a padded row, 2, 1) give the same tokens with graphs as without; steps
    serving adapters replay (a run of adapter requests alone replays every decode step)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, adapters = _gpu_files(tmp_path)
    ad = {n: adapters[n] for n in "abc"}
    steps = [("generate", LORAS, NEW), ("generate", ("a", "b", "c"), (8, 8, 8))]
    kw = dict(dtype="float32", max_loras_per_batch=3)
    got, counts, _, info, plan = _engine_run(model, ad, steps, cuda_graph_max_bs=4, **kw)
    assert plan.lora_backend == "triton" and info.cuda_graph_batch_sizes == BUCKETS
    assert any("with the LoRA path" in n for n in info.notes), info.notes
    (mixed, mixed_replays), (only, only_replays) = counts
    assert 0 < mixed_replays < mixed  # the steps of 5 ran eagerly
    assert only_replays == only > 0  # adapters alone, 3 rows in the bucket of 4: every step
    want, counts_off, stats_off, _, _ = _engine_run(model, ad, steps, disable_cuda_graph=True,
                                                    **kw)
    assert stats_off["graph_replays"] == 0
    assert got == want
    base = _engine_run(model, ad, [("generate", (None,) * 5, NEW)], disable_cuda_graph=True,
                       **kw)[0]
    assert any(g != b for g, b, lora in zip(got[0], base[0], LORAS, strict=True) if lora)


@pytest.mark.gpu
def test_a_slot_reloaded_between_replays_on_cuda(tmp_path):
    """One device slot, real graphs: a, then (a unloaded, d loaded) b, then d, each copied into
    the same slot between replays; the tokens equal the eager engine's under the same loads."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, adapters = _gpu_files(tmp_path)
    steps = [("generate", ("a",) * 3, (4, 3, 2)), ("unload", "a"), ("load", "d", adapters["d"]),
             ("generate", ("b",) * 3, (4, 3, 2)), ("generate", ("d",) * 3, (4, 3, 2))]
    ad = {n: adapters[n] for n in "ab"}
    kw = dict(dtype="float32", max_loras_per_batch=1)
    got, counts, stats, _, _ = _engine_run(model, ad, steps, cuda_graph_max_bs=4, **kw)
    assert all(replays == decode > 0 for decode, replays in counts)
    assert stats["lora_slot_loads"] >= 3  # a, b, d, each into the one slot
    want = _engine_run(model, ad, steps, disable_cuda_graph=True, **kw)[0]
    assert got == want and got[2] != got[0]


@pytest.mark.gpu
def test_lora_graphs_over_64_rows_at_llama_shapes_on_cuda(tmp_path):
    """Llama-3 layer shapes (4 layers, dummy weights), bf16, 8 rank-16 adapters on every
    projection, 96 requests round-robin over the adapters and the base: buckets above 64 rows
    (the triton backend's device-only steps, served token by token) replay with the adapters;
    the tokens mostly agree with eager decode (bf16: a padded batch can flip a near tie)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from types import SimpleNamespace

    from model_fixtures import write_config_adapter, write_config_model

    from conformance.model_configs import llama_config
    from core import Engine

    small = llama_config(  # Llama-3 layer shapes, 4 layers (tests/test_cuda_graph.py's)
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192,
        rope_scaling=None, bos_token_id=1, eos_token_id=2)
    model = write_config_model(tmp_path / "model", small)
    cfg = SimpleNamespace(**small)
    names = [f"l{i}" for i in range(8)]
    paths = {n: str(write_config_adapter(tmp_path / n, cfg, 16, 32, i, torch.bfloat16))
             for i, n in enumerate(names)}
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 30000) for _ in range(rng.randrange(8, 64))]
               for _ in range(96)]
    loras = [None if i % 9 == 8 else names[i % 8] for i in range(96)]
    runs = []
    for graphs in (True, False):
        with Engine(model, device="cuda", load_format="dummy", dtype="bfloat16",
                    max_total_tokens=16384, enable_lora=True, max_lora_rank=16,
                    max_loras_per_batch=8, lora_paths=[f"{n}={p}" for n, p in paths.items()],
                    **({"cuda_graph_max_bs": 96} if graphs else {"disable_cuda_graph": True})
                    ) as engine:
            outs = engine.generate(input_ids=prompts, lora_path=loras, sampling_params={
                "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
            stats = engine.stats()
        runs.append(([o["output_ids"] for o in outs], stats))
    (got, stats), (want, _) = runs
    assert stats["graph_replays"] == stats["forward_count"]["decode"] > 0
    assert all(a[:3] == b[:3] for a, b in zip(got, want, strict=True))
    same = sum(x == y for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=True))
    assert same >= 0.8 * sum(len(a) for a in got)
