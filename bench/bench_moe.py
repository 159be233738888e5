"""MoE runners compared on identical inputs (pytest-benchmark), on a CUDA GPU.

    pytest bench/bench_moe.py --benchmark-json=moe.json [--benchmark-group-by=group]

Shapes: the experts of Qwen3-30B-A3B (128 of width 768 over hidden 2048, top-8) and of
Mixtral-8x7B (8 of width 14336 over 4096, top-2), bf16, at decode (1, 8, 64 tokens) and
prefill (1,024 and 8,192 tokens) sizes. Every registered MoE runner that can run on this GPU
runs the same layer (routing included): `triton` (fused), `torch_native` (the per-expert loop,
the reference), and a peer built on `torch._grouped_mm` where the installed torch has it
(sort by expert, one grouped GEMM for gate+up and one for down, weighted scatter-add: what a
user would write with plain torch). What is timed is one `forward` with CUDA events and L2
flushed before every call (ceilings.py); pytest-benchmark's statistics are those GPU times.

Each case's extra_info holds TFLOP/s (2 * tokens * top_k * 3 * hidden * width) against the
bf16 matmul rate measured in the same session, GB/s over the expert bytes the routing touches
(every routed expert's w13 and w2 once) against the copy bandwidth, the speedup over
torch_native and the largest difference from it. A table and issue 13's kernel targets are
printed at the end (CORE_BENCH_TABLE=path also writes them). Without a CUDA device every case
is skipped, with that reason.
"""

from __future__ import annotations

import math

import pytest
import torch
from ceilings import EventClock, emit_table

from core.contract.moe import MoELayerParams, MoEWeights, route
from core.plan.checks import check_device
from core.plan.registry import get_registry

DTYPE = torch.bfloat16
# name -> (experts, top_k, hidden, intermediate)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 8, 64, 1024, 8192)
DECODE_MAX = 64  # token counts up to this are decode shapes (the copy-bandwidth target)
REFERENCE = "torch_native"
PEER = "grouped_mm"
TARGET_PREFILL = ("qwen3-30b-a3b", 8192)  # >= 0.45 of the matmul rate and >= 5x torch_native


def _cuda_runners() -> list[str]:
    target = "rocm" if torch.version.hip else "cuda"
    return sorted(n for n, r in get_registry().kind("moe").items() if target in r.caps.devices)


RUNNERS = _cuda_runners() + [PEER]


def grouped_mm_moe(x: torch.Tensor, logits: torch.Tensor, w: MoEWeights,
                   layer: MoELayerParams) -> torch.Tensor:
    """The plain-torch peer: tokens sorted by expert, torch._grouped_mm for both GEMMs (no host
    sync; offsets stay on the device), SiLU(gate) * up between, routing weights applied and
    summed per token in fp32."""
    weights, ids = route(logits, layer)
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=layer.num_experts), 0).to(torch.int32)
    xs = x[token]
    # w13 [E, 2I, H]: its transpose is the [E, H, 2I] operand, column-major per expert
    h = torch._grouped_mm(xs, w.w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    y = torch._grouped_mm(a, w.w2.transpose(1, 2), offs=offs)
    y = y.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y)
    return out.to(x.dtype)


@pytest.fixture(scope="session")
def results(request):
    rows: list[dict] = []
    yield rows
    if rows:
        _report(request.config, rows)


_LAYERS: dict[tuple, tuple] = {}
_REF: dict[tuple, tuple[torch.Tensor, float]] = {}


def _layer(model: str, tokens: int, device: torch.device) -> tuple:
    """x, router logits, weights, params of one layer (one shape in memory at a time)."""
    key = (model, tokens)
    if key not in _LAYERS:
        _LAYERS.clear()
        _REF.clear()
        torch.cuda.empty_cache()
        E, k, H, inter = MODELS[model]
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, H, device=device, dtype=DTYPE, generator=g)
        logits = torch.randn(tokens, E, device=device, dtype=DTYPE, generator=g)
        w13 = torch.randn(E, 2 * inter, H, device=device, dtype=DTYPE, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, inter, device=device, dtype=DTYPE, generator=g) * inter ** -0.5
        _LAYERS[key] = (x, logits, MoEWeights(w13, w2), MoELayerParams(0, E, k, H, inter))
    return _LAYERS[key]


def _runner_fn(name: str, layer_inputs: tuple):
    if name == PEER:
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("this torch has no torch._grouped_mm")
        return lambda: grouped_mm_moe(*layer_inputs)
    reg = get_registry().get("moe", name)
    reasons = check_device(reg.caps, get_registry().probe("rocm" if torch.version.hip
                                                          else "cuda"))
    if reasons:
        pytest.skip(f"{name} cannot run here: {'; '.join(reasons)}")
    runner = reg.load()()
    return lambda: runner.forward(*layer_inputs)


def _reference(model: str, tokens: int, layer_inputs: tuple, clock: EventClock) -> tuple:
    """torch_native's output and GPU seconds for this shape (measured once, also when only
    another runner's case is selected)."""
    key = (model, tokens)
    if key not in _REF:
        fn = _runner_fn(REFERENCE, layer_inputs)
        out = fn()
        for _ in range(3):
            clock.run(fn)
        _REF[key] = (out, clock.median(3))
    return _REF[key]


@pytest.mark.parametrize(("model", "tokens", "runner"),
                         [(m, t, r) for m in MODELS for t in TOKENS for r in RUNNERS])
def test_moe(benchmark, gpu, ceilings, clock, results, model, tokens, runner):
    inputs = _layer(model, tokens, gpu)
    x, logits, weights, layer = inputs
    fn = _runner_fn(runner, inputs)
    try:
        out = fn()  # compiles / autotunes
        clock.run(fn)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        pytest.skip(f"out of memory at this shape: {str(exc).splitlines()[0]}")
    ref_out, ref_s = _reference(model, tokens, inputs, EventClock(gpu))
    err = (out.float() - ref_out.float()).abs().max().item()
    scale = ref_out.float().abs().max().item()
    # a runner that computes something else is not benchmarked (bf16: ~1e-2 of the scale)
    assert err <= 0.05 * scale + 1e-3, f"{runner} differs from {REFERENCE} by {err} ({scale})"
    rounds = max(5, min(50, math.ceil(0.5 / max(clock.samples[-1], 1e-6))))
    benchmark.group = f"moe {model} T={tokens}"
    benchmark.pedantic(clock.run, args=(fn,), rounds=rounds, warmup_rounds=1, iterations=1)
    seconds = clock.median(rounds)
    E, k, H, inter = MODELS[model]
    touched = route(logits, layer)[1].unique().numel()
    flop = 2 * tokens * k * 3 * H * inter
    nbytes = touched * 3 * H * inter * x.element_size()
    info = dict(runner=runner, model=model, tokens=tokens, median_ms=seconds * 1e3,
                achieved_TFLOPs=flop / seconds / 1e12,
                ratio_to_matmul=flop / seconds / ceilings.matmul_flop_per_s,
                achieved_GBps=nbytes / seconds / 1e9,
                ratio_to_copy=nbytes / seconds / ceilings.copy_bytes_per_s,
                speedup_vs_torch_native=ref_s / seconds, max_abs_diff_vs_torch_native=err,
                **ceilings.as_info())
    benchmark.extra_info.update(info)
    results.append(info)


def _report(config, rows: list[dict]) -> None:
    c = rows[0]
    lines = [f"MoE runners on {c['device']}: copy {c['copy_GBps']:.0f} GB/s, "
             f"{c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.0f} TFLOP/s (measured this run)",
             "", "| model | tokens | runner | median ms | TFLOP/s (of matmul) | GB/s of experts "
             "(of copy) | x torch_native |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['runner']} | {r['median_ms']:.3f} | "
                     f"{r['achieved_TFLOPs']:.1f} ({r['ratio_to_matmul']:.2f}) | "
                     f"{r['achieved_GBps']:.0f} ({r['ratio_to_copy']:.2f}) | "
                     f"{r['speedup_vs_torch_native']:.2f}x |")
    lines += ["", "Issue-13 kernel targets (triton):"]
    for r in rows:
        if r["runner"] != "triton":
            continue
        if (r["model"], r["tokens"]) == TARGET_PREFILL:
            lines.append(f"- prefill {r['model']} T={r['tokens']}: {r['ratio_to_matmul']:.2f} "
                         f"of the matmul rate (target >= 0.45), "
                         f"{r['speedup_vs_torch_native']:.2f}x torch_native (target >= 5)")
        elif r["tokens"] <= DECODE_MAX:
            lines.append(f"- decode {r['model']} T={r['tokens']}: {r['ratio_to_copy']:.2f} of "
                         "copy bandwidth over the experts touched (target >= 0.6)")
    emit_table(config, "\n".join(lines))
