"""Attention backends compared on identical inputs (pytest-benchmark), on a CUDA GPU.

    pytest bench/bench_attention.py --benchmark-json=attention.json

Every registered attention backend that can run on this GPU runs the same steps: decode (batch
1..256, context 512..32k) and extend (one request, cached prefix 0..8k, new tokens 128..4k), Llama
3 8B attention geometry (32 query heads, 8 KV heads, head dim 128), bf16, page size 16 with pages
scattered over the pool. What is timed is one layer's `forward` (KV write + attention) after the
step's `prepare`, with CUDA events and L2 flushed before every call (see ceilings.py); the
statistics pytest-benchmark records are those GPU times. Groups are shapes, so
`--benchmark-group-by=group` puts the backends of one shape side by side.

Each case's extra_info holds the achieved rate next to the ceiling measured in the same session:
decode: GB/s of K/V read + q/o (and the new K/V) vs the device's copy bandwidth; extend: TFLOP/s
(4 * head_dim FLOP per visible query-key pair and head) vs its bf16 matmul rate; with the ratios.
A table (and the issue-5 targets) is printed at the end; CORE_BENCH_TABLE=path also writes it.
Two more groups sweep the Triton kernels' tilings at the target shapes, for tuning.
Without a CUDA device every case is skipped, with that reason.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
from ceilings import EventClock, emit_table

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.engine.memory.kv_cache import KVPool
from core.plan.checks import check_device
from core.plan.registry import get_registry

H, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(b, c) for b in (1, 32, 64, 256) for c in (512, 4096, 32768)]
EXTEND_SHAPES = [(p, n) for p in (0, 4096, 8192) for n in (128, 4096)]
REFERENCE = "torch_native"
TARGET_DECODE = (32, 4096)  # batch >= 32 and context >= 4k: triton >= 75% of copy bandwidth
TARGET_EXTEND = (4096, 4096)  # prefix 4k + new 4k: triton >= 40% of the bf16 matmul rate
# Triton tilings swept at the target shapes: decode (block_n, warps, stages, waves),
# extend (block_m, block_n, warps, stages[, pack_gqa[, maxnreg]]).
# (Compiled for sm90, decode stages 2-4 all keep one K/V buffer in flight; 5 double-buffers.)
DECODE_TILINGS = [(64, 4, 3, 4), (32, 4, 2, 4), (32, 4, 5, 4), (64, 4, 5, 4), (128, 4, 2, 4),
                  (64, 8, 3, 4), (64, 4, 3, 2), (64, 4, 3, 8)]
EXTEND_TILINGS = [(128, 64, 8, 3, True, 128), (256, 64, 16, 3, True), (128, 64, 8, 3),
                  (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3, False, 128)]


def _cuda_backends() -> list[str]:
    target = "rocm" if torch.version.hip else "cuda"
    return sorted(n for n, r in get_registry().kind("attention").items()
                  if target in r.caps.devices)


BACKENDS = _cuda_backends()


@pytest.fixture(scope="session")
def results(request):
    rows: list[dict] = []
    yield rows
    if rows:
        _report(request.config, rows)


@dataclass
class Step:
    """One layer's inputs for one step, shared by every backend of a shape."""

    batch: ForwardBatch
    ctx: BackendContext
    layer: AttentionLayerParams
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


_STEPS: dict[tuple, Step] = {}


def _step(mode: str, batch_size: int, prefix: int, new: int, device: torch.device) -> Step:
    """Requests of `prefix` cached + `new` tokens each, pages of 16 scattered over the pool."""
    key = (mode, batch_size, prefix, new)
    if key not in _STEPS:
        _STEPS.clear()  # one shape in memory at a time (the largest pool is ~34 GB)
        torch.cuda.empty_cache()
        _STEPS[key] = _build_step(mode, batch_size, prefix, new, device)
    return _STEPS[key]


def _build_step(mode, batch_size, prefix, new, device) -> Step:
    seq = prefix + new
    pages_per_req = -(-seq // PAGE)
    num_pages = batch_size * pages_per_req + 1  # page 0: the padding sink
    perm = torch.randperm(num_pages - 1, device=device) + 1
    pages = perm.view(batch_size, pages_per_req)
    slots = (pages[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(batch_size, -1)
    req_to_token = slots[:, :seq].to(torch.int32).contiguous()  # [B, seq]
    pool = KVPool(num_pages * PAGE, 1, HKV, D, DTYPE, device, PAGE)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.normal_()
    T = batch_size * new
    out_loc = slots[:, prefix:seq].reshape(-1).to(torch.int64)
    lens = lambda n: torch.full((batch_size,), n, dtype=torch.int32, device=device)  # noqa: E731
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
        input_ids=torch.zeros(T, dtype=torch.int64, device=device),
        positions=torch.arange(prefix, seq, device=device).repeat(batch_size),
        seq_lens=lens(seq), prefix_lens=lens(prefix), extend_lens=lens(new),
        out_cache_loc=out_loc, req_pool_indices=torch.arange(batch_size, device=device),
        req_to_token=req_to_token, kv_pool=pool, seq_lens_cpu=[seq] * batch_size,
        prefix_lens_cpu=[prefix] * batch_size, extend_lens_cpu=[new] * batch_size)
    ctx = BackendContext(num_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=1, dtype=DTYPE,
                         kv_dtype=DTYPE, device=device, page_size=PAGE, max_context_len=seq)
    layer = AttentionLayerParams(layer_id=0, num_heads=H, num_kv_heads=HKV, head_dim=D,
                                 scaling=D ** -0.5)
    q = torch.randn(T, H * D, dtype=DTYPE, device=device)
    k = torch.randn(T, HKV * D, dtype=DTYPE, device=device)
    v = torch.randn(T, HKV * D, dtype=DTYPE, device=device)
    return Step(batch, ctx, layer, q, k, v)


def _forward_fn(name: str, step: Step, device: torch.device):
    """The backend's per-layer call, after its per-step prepare (timed apart, host side)."""
    reg = get_registry().get("attention", name)
    info = get_registry().probe("rocm" if torch.version.hip else "cuda")
    reasons = check_device(reg.caps, info)
    if reasons:
        pytest.skip(f"{name} cannot run here: {'; '.join(reasons)}")
    backend = reg.load()(step.ctx)
    batch = step.batch
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    batch.attn_backend, batch.attn_meta = backend, backend.prepare(batch)
    torch.cuda.synchronize(device)
    prepare_ms = (time.perf_counter() - t0) * 1e3
    return (lambda: backend.forward(step.q, step.k, step.v, step.layer, batch)), prepare_ms


def _time(benchmark, clock: EventClock, fn) -> float:
    """Median GPU seconds of `fn` through pytest-benchmark (compile/autotune happen first)."""
    try:
        clock.run(fn)
        clock.run(fn)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        pytest.skip(f"out of memory at this shape: {str(exc).splitlines()[0]}")
    rounds = max(5, min(50, math.ceil(0.5 / max(clock.samples[-1], 1e-6))))
    benchmark.pedantic(clock.run, args=(fn,), rounds=rounds, warmup_rounds=1, iterations=1)
    return clock.median(rounds)


def _decode_bytes(batch_size: int, context: int) -> int:
    elem = torch.tensor([], dtype=DTYPE).element_size()
    kv_read = batch_size * context * HKV * D * 2 * elem
    q_out = batch_size * H * D * 2 * elem
    kv_write = batch_size * HKV * D * 2 * elem
    return kv_read + q_out + kv_write


def _extend_flops(batch_size: int, prefix: int, new: int) -> float:
    pairs = new * prefix + new * (new + 1) / 2  # visible (query, key) pairs, causal
    return 4.0 * D * H * pairs * batch_size


@pytest.mark.parametrize(("batch_size", "context", "backend"),
                         [(b, c, n) for b, c in DECODE_SHAPES for n in BACKENDS])
def test_decode(benchmark, gpu, ceilings, clock, results, batch_size, context, backend):
    step = _step("decode", batch_size, context - 1, 1, gpu)
    fn, prepare_ms = _forward_fn(backend, step, gpu)
    benchmark.group = f"decode B={batch_size} ctx={context}"
    seconds = _time(benchmark, clock, fn)
    rate = _decode_bytes(batch_size, context) / seconds
    info = dict(backend=backend, phase="decode", batch=batch_size, context=context,
                median_ms=seconds * 1e3, prepare_ms=prepare_ms, achieved_GBps=rate / 1e9,
                ratio_to_copy=rate / ceilings.copy_bytes_per_s, **ceilings.as_info())
    benchmark.extra_info.update(info)
    results.append(info)


@pytest.mark.parametrize(("prefix", "new", "backend"),
                         [(p, n, b) for p, n in EXTEND_SHAPES for b in BACKENDS])
def test_extend(benchmark, gpu, ceilings, clock, results, prefix, new, backend):
    step = _step("extend", 1, prefix, new, gpu)
    fn, prepare_ms = _forward_fn(backend, step, gpu)
    benchmark.group = f"extend prefix={prefix} new={new}"
    seconds = _time(benchmark, clock, fn)
    rate = _extend_flops(1, prefix, new) / seconds
    info = dict(backend=backend, phase="extend", prefix=prefix, new=new,
                median_ms=seconds * 1e3, prepare_ms=prepare_ms, achieved_TFLOPs=rate / 1e12,
                ratio_to_matmul=rate / ceilings.matmul_flop_per_s, **ceilings.as_info())
    benchmark.extra_info.update(info)
    results.append(info)


def _triton_or_skip():
    if "triton" not in BACKENDS:
        pytest.skip("the triton backend is not registered")
    return pytest.importorskip("triton")


@pytest.mark.parametrize("tiling", DECODE_TILINGS, ids=lambda t: "bn{}-w{}-s{}-waves{}".format(*t))
@pytest.mark.parametrize(("batch_size", "context"), [TARGET_DECODE, (64, 32768)])
def test_triton_decode_tiling(benchmark, gpu, ceilings, clock, batch_size, context, tiling):
    _triton_or_skip()
    from plugins.attention.triton.common import DecodeConfig
    from plugins.attention.triton.decode import decode_attention, decode_splits

    step = _step("decode", batch_size, context - 1, 1, gpu)
    block_n, warps, stages, waves = tiling
    cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, waves=waves)
    splits = decode_splits(batch_size, H, HKV, D, D, DTYPE, gpu, config=cfg)
    k_buf, v_buf = step.batch.kv_pool.get_kv_buffer(0)
    b = step.batch

    def fn():
        decode_attention(step.q.view(-1, H, D), k_buf, v_buf, b.req_to_token,
                         b.req_pool_indices, b.seq_lens, scaling=step.layer.scaling,
                         num_splits=splits, config=cfg)

    benchmark.group = f"triton decode tiling B={batch_size} ctx={context}"
    seconds = _time(benchmark, clock, fn)
    rate = _decode_bytes(batch_size, context) / seconds
    benchmark.extra_info.update(dict(tiling=str(cfg), splits=splits, median_ms=seconds * 1e3,
                                     achieved_GBps=rate / 1e9,
                                     ratio_to_copy=rate / ceilings.copy_bytes_per_s))


def _extend_tiling_id(t: tuple) -> str:
    packed = "-packed" if len(t) > 4 and t[4] else ""
    regs = f"-r{t[5]}" if len(t) > 5 and t[5] else ""
    return "m{}-n{}-w{}-s{}".format(*t) + packed + regs


@pytest.mark.parametrize("tiling", EXTEND_TILINGS, ids=_extend_tiling_id)
def test_triton_extend_tiling(benchmark, gpu, ceilings, clock, tiling):
    _triton_or_skip()
    from plugins.attention.triton.common import ExtendConfig
    from plugins.attention.triton.extend import extend_attention

    prefix, new = TARGET_EXTEND
    step = _step("extend", 1, prefix, new, gpu)
    cfg = ExtendConfig(*tiling)
    k_buf, v_buf = step.batch.kv_pool.get_kv_buffer(0)
    b = step.batch
    starts = torch.zeros(1, dtype=torch.int32, device=gpu)

    def fn():
        extend_attention(step.q.view(-1, H, D), k_buf, v_buf, b.req_to_token,
                         b.req_pool_indices, b.seq_lens, b.extend_lens, starts, new,
                         scaling=step.layer.scaling, config=cfg)

    benchmark.group = f"triton extend tiling prefix={prefix} new={new}"
    try:
        seconds = _time(benchmark, clock, fn)
    except Exception as exc:  # noqa: BLE001 - e.g. a tiling over the shared-memory limit
        if "OutOfResources" in type(exc).__name__ or "out of resource" in str(exc):
            pytest.skip(f"tiling {cfg} does not fit this GPU: {exc}")
        raise
    rate = _extend_flops(1, prefix, new) / seconds
    benchmark.extra_info.update(dict(tiling=str(cfg), median_ms=seconds * 1e3,
                                     achieved_TFLOPs=rate / 1e12,
                                     ratio_to_matmul=rate / ceilings.matmul_flop_per_s))


def _report(config, rows: list[dict]) -> None:
    """Markdown table of every case, speedups over torch_native, and the issue-5 targets."""
    ref = {_shape(r): r["median_ms"] for r in rows if r["backend"] == REFERENCE}
    c = rows[0]
    lines = [f"Attention backends on {c['device']}: copy {c['copy_GBps']:.0f} GB/s, "
             f"{c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.0f} TFLOP/s (measured this run)",
             "", "| phase | shape | backend | median ms | achieved | ratio to ceiling | "
             "speedup vs torch_native |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        achieved = (f"{r['achieved_GBps']:.0f} GB/s" if r["phase"] == "decode"
                    else f"{r['achieved_TFLOPs']:.1f} TFLOP/s")
        ratio = r.get("ratio_to_copy", r.get("ratio_to_matmul"))
        base = ref.get(_shape(r))
        speedup = f"{base / r['median_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['phase']} | {_shape(r)} | {r['backend']} | {r['median_ms']:.3f} | "
                     f"{achieved} | {ratio:.2f} | {speedup} |")
    lines += ["", *_targets(rows, ref)]
    emit_table(config, "\n".join(lines))


def _shape(r: dict) -> str:
    if r["phase"] == "decode":
        return f"B={r['batch']} ctx={r['context']}"
    return f"prefix={r['prefix']} new={r['new']}"


def _targets(rows: list[dict], ref: dict) -> list[str]:
    out = ["Issue-5 targets (triton):"]
    dec = [r for r in rows if r["backend"] == "triton" and r["phase"] == "decode"
           and r["batch"] >= TARGET_DECODE[0] and r["context"] >= TARGET_DECODE[1]]
    for r in dec:
        base = ref.get(_shape(r))
        out.append(f"- decode {_shape(r)}: {r['ratio_to_copy']:.2f} of copy bandwidth "
                   f"(target >= 0.75), {base / r['median_ms']:.2f}x torch_native (target >= 2)"
                   if base else f"- decode {_shape(r)}: {r['ratio_to_copy']:.2f} of copy "
                   f"bandwidth (target >= 0.75), torch_native not measured")
    ext = [r for r in rows if r["backend"] == "triton" and r["phase"] == "extend"
           and (r["prefix"], r["new"]) == TARGET_EXTEND]
    for r in ext:
        base = ref.get(_shape(r))
        speed = f"{base / r['median_ms']:.2f}x torch_native" if base else "no torch_native"
        out.append(f"- extend {_shape(r)}: {r['ratio_to_matmul']:.2f} of matmul rate "
                   f"(target >= 0.40), {speed} (target >= 2)")
    return out
