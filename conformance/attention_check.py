"""Run one conformance case on one attention backend and check everything it did.

Checks, in order (the first failure raises AssertionError with what went wrong):
1. the output has the contract's shape [T, H*Dv] and q's dtype, and every element is finite
   (outputs may come from poisoned memory, so an element never written shows as NaN);
2. the KV write: the new tokens' K/V sit at `out_cache_loc` (exactly, or within one FP8 step),
   and nothing else in the pool changed, other layers included;
3. the output matches the fp32 reference computed from the pool (`attention_reference`);
4. the output matches the `torch_native` backend run on the same inputs (skipped for
   torch_native itself).
Tolerances depend on the compute dtype only.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from conformance.attention_reference import reference_attention
from conformance.paged_batch import (
    FP8,
    TORCH_DTYPES,
    AttentionCase,
    PagedInputs,
    build_inputs,
    dequantize,
)
from core.contract.attention import AttentionBackend
from core.contract.capabilities import DeviceInfo
from core.engine.memory.kv_cache import KVPool
from core.plan.checks import check_device
from core.plan.registry import Registration

REFERENCE = "torch_native"
# (atol, rtol) against the fp32 reference; against torch_native both sides err, so twice that.
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (3e-3, 3e-3), "bfloat16": (2.5e-2, 2.5e-2)}
# One step of the FP8 format, relative: a writer may round the other way.
_FP8_STEP = {"fp8_e4m3": 0.13, "fp8_e5m2": 0.26}


def device_target(device: torch.device) -> str:
    """The hardware target name of a torch device (ROCm runs under torch's cuda device)."""
    if device.type == "cuda" and torch.version.hip:
        return "rocm"
    return device.type


def triton_interpreter(reg: Registration, device: torch.device) -> bool:
    """A Triton backend on CPU under TRITON_INTERPRET=1: runnable there, for tests only."""
    return (device.type == "cpu" and "triton" in reg.caps.requires
            and os.environ.get("TRITON_INTERPRET", "") not in ("", "0"))


def unavailable_reasons(reg: Registration, device: torch.device,
                        info: DeviceInfo | None = None) -> list[str]:
    """Why this backend cannot run on `device` ([] when it can)."""
    target = device_target(device)
    info = info or DeviceInfo(target=target, device_type=device.type)
    reasons = check_device(reg.caps, info)
    if triton_interpreter(reg, device):  # declared for GPUs; the interpreter runs it on CPU
        reasons = [r for r in reasons if not r.startswith("device ")]
    return reasons


def excluded_dtype_reasons(reg: Registration, device: torch.device) -> dict[str, str]:
    """Declared compute dtypes the suite leaves out on `device`, with why."""
    if triton_interpreter(reg, device):
        return {"bfloat16": "not run under the Triton interpreter (it computes bf16 dots and "
                            "arithmetic wrongly); a GPU check"}
    return {}


def excluded_dtypes(reg: Registration, device: torch.device) -> tuple[str, ...]:
    return tuple(excluded_dtype_reasons(reg, device))


def _poison_allocator(nbytes: int, device: torch.device) -> None:
    """Leave NaN-filled blocks in the allocator, so that an output element the backend never
    writes is likely to read NaN (reliable with CUDA's caching allocator, best effort on CPU)."""
    for size in (nbytes, 2 * nbytes):
        torch.full((max(1, size // 4),), float("nan"), dtype=torch.float32, device=device)


def run_backend(backend: AttentionBackend, inputs: PagedInputs) -> list[torch.Tensor]:
    """One step as the model runner does it: prepare once, then every layer's forward."""
    batch = inputs.batch
    batch.attn_backend = backend
    batch.attn_meta = backend.prepare(batch)
    outs = []
    for layer, (q, k, v) in zip(inputs.layers, inputs.qkv, strict=True):
        dv = layer.v_head_dim or layer.head_dim
        _poison_allocator(q.shape[0] * layer.num_heads * dv * 4, q.device)
        outs.append(backend.forward(q, k, v, layer, batch))
    return outs


def reference_inputs(inputs: PagedInputs) -> PagedInputs:
    """The same step for the reference backend (call it after the backend ran); an FP8 cache
    becomes its dequantized values in the compute dtype."""
    case, pool = inputs.case, inputs.pool
    if case.kv_dtype not in FP8:
        pool_copy = KVPool(pool.num_slots, pool.num_layers, pool.num_kv_heads, pool.head_dim,
                           pool.dtype, pool.device, pool.page_size)
        for layer_id, (k0, v0) in enumerate(inputs.before):
            pool_copy.k_buffers[layer_id].copy_(k0)
            pool_copy.v_buffers[layer_id].copy_(v0)
        qkv = inputs.qkv
    else:
        dtype = TORCH_DTYPES[case.dtype]
        pool_copy = KVPool(pool.num_slots, pool.num_layers, pool.num_kv_heads, pool.head_dim,
                           dtype, pool.device, pool.page_size)
        for layer_id, (k0, v0) in enumerate(inputs.before):
            pool_copy.k_buffers[layer_id].copy_(dequantize(k0, pool.k_scale).to(dtype))
            pool_copy.v_buffers[layer_id].copy_(dequantize(v0, pool.v_scale).to(dtype))

        # The new K/V as the backend stored them (checked against the expected values first),
        # so both sides attend over the very same numbers.
        loc = inputs.batch.out_cache_loc
        qkv = []
        for layer, (q, k, v) in zip(inputs.layers, inputs.qkv, strict=True):
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
            qkv.append((q, dequantize(k_buf[loc], pool.k_scale).to(k.dtype).view_as(k),
                        dequantize(v_buf[loc], pool.v_scale).to(v.dtype).view_as(v)))
    batch = replace(inputs.batch, kv_pool=pool_copy, attn_backend=None, attn_meta=None)
    ctx = replace(inputs.ctx, kv_dtype=pool_copy.dtype)
    return PagedInputs(case, ctx, pool_copy, batch, inputs.layers, qkv)


def _check_pool(inputs: PagedInputs, name: str) -> None:
    pool, case = inputs.pool, inputs.case
    written = torch.zeros(pool.num_slots, dtype=torch.bool, device=pool.device)
    written[inputs.batch.out_cache_loc] = True
    run_layers = {layer.layer_id for layer in inputs.layers}
    for layer_id in range(pool.num_layers):
        actual_kv = pool.get_kv_buffer(layer_id)
        for which, actual, before, expected, scale in zip(
                "KV", actual_kv, inputs.before[layer_id], inputs.expected[layer_id],
                (pool.k_scale, pool.v_scale), strict=True):
            where = f"{name}: {which} cache of layer {layer_id}"
            keep = ~written if layer_id in run_layers else torch.ones_like(written)
            torch.testing.assert_close(
                actual[keep].float(), before[keep].float(), rtol=0, atol=0, equal_nan=True,
                msg=lambda m, w=where: f"{w}: slots this step must not touch changed\n{m}")
            if layer_id not in run_layers:
                continue
            got = dequantize(actual[written], scale)
            want = dequantize(expected[written], scale)
            if not torch.isfinite(got).all():
                bad = (~torch.isfinite(got)).any(-1).any(-1).nonzero().flatten()[:8].tolist()
                raise AssertionError(f"{where}: new tokens were not written (poison left at "
                                     f"out_cache_loc positions {bad})")
            step = _FP8_STEP.get(case.kv_dtype, 0.0)
            atol = 2e-3 * scale if step else 0.0
            torch.testing.assert_close(
                got, want, rtol=step, atol=atol,
                msg=lambda m, w=where: f"{w}: new tokens written wrongly\n{m}")


def _check_close(out: torch.Tensor, want: torch.Tensor, case: AttentionCase, what: str,
                 factor: float = 1.0) -> None:
    atol, rtol = TOLERANCES[case.dtype]
    torch.testing.assert_close(
        out.float(), want.float(), atol=atol * factor, rtol=rtol * factor,
        msg=lambda m: f"{what} ({case.dtype}, atol={atol * factor:g}, "
                      f"rtol={rtol * factor:g})\n{m}")


def check_case(reg: Registration, case: AttentionCase, device: torch.device, seed: int = 0,
               reference: Registration | None = None) -> None:
    """Run `case` on the backend `reg` and check it; AssertionError says what is wrong."""
    device = torch.device(device)
    inputs = build_inputs(case, device, case.seed(seed))
    backend = reg.load()(inputs.ctx)
    outs = run_backend(backend, inputs)
    T = inputs.batch.input_ids.shape[0]
    for layer, (q, _, _), out in zip(inputs.layers, inputs.qkv, outs, strict=True):
        what = f"{reg.name} layer {layer.layer_id} {case.mode}"
        dv = layer.v_head_dim or layer.head_dim
        if tuple(out.shape) != (T, layer.num_heads * dv) or out.dtype != q.dtype:
            raise AssertionError(f"{what}: output is {tuple(out.shape)} {out.dtype}, the "
                                 f"contract says ({T}, {layer.num_heads * dv}) {q.dtype}")
        if not torch.isfinite(out).all():
            rows = (~torch.isfinite(out)).any(-1).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{what}: non-finite output at tokens {rows} (unwritten "
                                 f"output, or poisoned K/V was read)")
    _check_pool(inputs, reg.name)
    pool = inputs.pool
    for layer, (q, _, _), out in zip(inputs.layers, inputs.qkv, outs, strict=True):
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        want = reference_attention(q, k_buf, v_buf, layer, inputs.batch, pool.k_scale,
                                   pool.v_scale)
        _check_close(out, want, case, f"{reg.name} layer {layer.layer_id} {case.mode} output "
                                      f"differs from the fp32 reference")
    if reference is None or reference.name == reg.name:
        return
    ref_inputs = reference_inputs(inputs)
    ref_outs = run_backend(reference.load()(ref_inputs.ctx), ref_inputs)
    for layer, out, ref in zip(inputs.layers, outs, ref_outs, strict=True):
        _check_close(out, ref, case, f"{reg.name} layer {layer.layer_id} {case.mode} output "
                                     f"differs from {reference.name}'s", factor=2.0)
