"""Reference checkpoints for the quant-method conformance suite: a dense fp32 weight quantized
by an independent implementation of each format, in the tensor names and shapes the real
checkpoints use, with the fp32 weight those tensors mean.

FP8 and INT8 tensors come from the `compressed-tensors` package (the library that writes those
checkpoints); INT4 from conformance/quant_refs_int4.py (the formats' published packing).
A case (`RefCase`) is one checkpoint form: its HF quantization_config, the builder of one
linear's tensors, and how the reference treats activations. `online_cases` gives the case of a
method's quantization at load, from what it declares (QuantCaps.online_scheme()): core's
online formats with dynamic or no activation quantization get an exact reference; any other
format (a plugin's own) gets the dense product with a bound on the quantization error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.contract.quant import reciprocal

FP8_MAX = 448.0

# (tensors by checkpoint suffix, the dequantized fp32 weight [N, K])
Built = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RefCase:
    """name: case id. config: the quantization_config a checkpoint of this form carries
    (None: a dense checkpoint quantized at load; `online` names the method's online format).
    build(weight fp32 [N, K]) -> (tensors of one projection by suffix, dequantized [N, K]).
    acts: "none" | "fp8_token" | "fp8_group" | "fp8_static" | "int8_token" - how the
    reference quantizes x. k_multiple / n_multiple: shape grain the format needs.
    slack(x, w) (None: 0): the relative error allowed beyond the dtype's tolerance, for a
    case whose reference is the dense product of x [M, K] and w [N, K] (fp32) rather than the
    exact dequantized weights (a format the suite cannot rebuild: `bounded_slack`).
    experts (None: as `build`): build for one MoE expert projection, where the checkpoint
    holds experts in another form than its linears (mxfp4: dense linears, packed experts);
    a case with it is checked on MoE experts whatever its activations. moe_edges (None: none):
    the format's own edge checks, called with make(hidden, inter, tamper) -> a
    quant_suite.MoEExpertsCase whose expert tensors `tamper(expert, proj, tensors)` may edit
    before loading."""

    name: str
    format: str
    config: dict[str, Any] | None
    build: Callable[[torch.Tensor], Built]
    acts: str
    k_multiple: int = 16
    n_multiple: int = 16
    static_scale: float | None = None
    online: bool = False
    tags: tuple[str, ...] = field(default=())
    slack: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    experts: Callable[[torch.Tensor], Built] | None = None
    moe_edges: Callable[[Callable[..., Any]], None] | None = None


def _ct():
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the quant conformance suite needs the compressed-tensors package "
                          "(pip install compressed-tensors)") from exc
    return QuantizationArgs, quantize, dequantize, calculate_qparams


def _ct_quantize(w: torch.Tensor, kind: str, strategy: str, block=None) -> tuple:
    """compressed-tensors' own quantization of w: (q, scale, dequantized fp32)."""
    QuantizationArgs, quantize, dequantize, calculate_qparams = _ct()
    kw = {"block_structure": list(block)} if block else {}
    args = QuantizationArgs(num_bits=8, type=kind, strategy=strategy, symmetric=True, **kw)
    if strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:
        n, k = w.shape
        b = w.reshape(n // block[0], block[0], k // block[1], block[1])
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    dtype = torch.float8_e4m3fn if kind == "float" else torch.int8
    q = quantize(w, scale, zero, args, dtype=dtype)
    return q, scale, dequantize(q, scale, zero, args).float()


def _ct_config(kind: str, strategy: str, acts: dict | None, fmt: str, block=None) -> dict:
    weights = {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True,
               "dynamic": False, "block_structure": list(block) if block else None}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


def _fp8_block(name_of_scale: str) -> Callable[[torch.Tensor], Built]:
    def build(w: torch.Tensor) -> Built:
        q, scale, deq = _ct_quantize(w, "float", "block", (128, 128))
        return {"weight": q, name_of_scale: scale}, deq
    return build


def deepseek_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block FP8 as its own conversion script defines it, for any shape: per
    block of w [N, K] (the last row / column blocks partial where 128 does not divide N or K),
    scale_inv = amax / 448 (fp32); codes = e4m3(w / scale_inv); the weight the file means is
    codes * scale_inv. -> (codes e4m3 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)],
    dequantized fp32 [N, K])."""
    w = w.float()
    n, k = w.shape
    bn, bk = block
    pn, pk = (-n) % bn, (-k) % bk
    blocks = torch.nn.functional.pad(w, (0, pk, 0, pn)).reshape(
        (n + pn) // bn, bn, (k + pk) // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [N/bn, K/bk]
    per_elem = scale[:, None, :, None].expand_as(blocks)
    codes = (blocks / per_elem).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (codes.float() * per_elem).reshape(n + pn, k + pk)[:n, :k]
    return codes.reshape(n + pn, k + pk)[:n, :k].contiguous(), scale.contiguous(), deq


def _per(kind: str, strategy: str, scale_shape=None) -> Callable[[torch.Tensor], Built]:
    def build(w: torch.Tensor) -> Built:
        q, scale, deq = _ct_quantize(w, kind, strategy)
        if scale_shape is not None:
            scale = scale.reshape(scale_shape)
        return {"weight": q, "weight_scale": scale}, deq
    return build


def _static(build: Callable[[torch.Tensor], Built], scale: float):
    def with_input_scale(w: torch.Tensor) -> Built:
        tensors, deq = build(w)
        return {**tensors, "input_scale": torch.tensor([scale])}, deq
    return with_input_scale


def _online(kind: str) -> Callable[[torch.Tensor], Built]:
    """A dense checkpoint's weight; what it means once quantized at load: per-channel
    symmetric scales amax / qmax (448 for e4m3 - compressed-tensors' own quantizer -, 127 for
    int8 as vLLM and SGLang quantize online; compressed-tensors' int8 uses 127.5)."""
    def build(w: torch.Tensor) -> Built:
        if kind == "float":
            return {"weight": w.clone()}, _ct_quantize(w, "float", "channel")[2]
        s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.0
        return {"weight": w.clone()}, torch.round(w / s).clamp(-128, 127) * s
    return build


_TOKEN_FP8 = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
              "symmetric": True}
_TOKEN_INT8 = {**_TOKEN_FP8, "type": "int"}
_STATIC_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
               "symmetric": True}
STATIC_SCALE = 0.02  # x is drawn at unit scale: amax ~4 -> 4 / 0.02 = 200 < 448

CASES: tuple[RefCase, ...] = (
    RefCase("fp8-block-qwen3", "fp8_block",
            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}, _fp8_block("weight_scale_inv"), "fp8_group",
            k_multiple=128, n_multiple=128),
    RefCase("fp8-block-ct", "fp8_block",
            _ct_config("float", "block", {**_TOKEN_FP8, "strategy": "group", "group_size": 128},
                       "float-quantized", (128, 128)),
            _fp8_block("weight_scale"), "fp8_group", k_multiple=128, n_multiple=128),
    RefCase("fp8-channel-ct", "fp8_channel",
            _ct_config("float", "channel", _TOKEN_FP8, "float-quantized"),
            _per("float", "channel"), "fp8_token"),
    RefCase("fp8-tensor-static-ct", "fp8_tensor",
            _ct_config("float", "tensor", _STATIC_FP8, "float-quantized"),
            _static(_per("float", "tensor"), STATIC_SCALE), "fp8_static",
            static_scale=STATIC_SCALE),
    RefCase("fp8-tensor-dynamic", "fp8_tensor",
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            _per("float", "tensor", ()), "fp8_token"),
    RefCase("fp8-fbgemm", "fp8_channel", {"quant_method": "fbgemm_fp8"},
            _per("float", "channel"), "fp8_token"),
    RefCase("fp8-online", "fp8_channel", None, _online("float"), "fp8_token", online=True),
    RefCase("int8-channel-ct", "int8_channel",
            _ct_config("int", "channel", _TOKEN_INT8, "int-quantized"),
            _per("int", "channel"), "int8_token"),
    RefCase("int8-online", "int8_channel", None, _online("int"), "int8_token", online=True),
)


def fake_quant_acts(x: torch.Tensor, acts: str, static_scale: float | None = None
                    ) -> torch.Tensor:
    """x [M, K] -> fp32, quantized and dequantized the way the case's activations are: per row
    (token), per 128 inputs of a row (group), or by one static scale; amax / qmax scales, each
    input times the scale's reciprocal (core.contract.quant.reciprocal: the kernels' rounding)."""
    x = x.float()
    if acts == "none":
        return x
    if acts == "fp8_static":
        st = torch.tensor(static_scale, dtype=torch.float32)
        return (x * reciprocal(st)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() \
            * st
    if acts == "fp8_group":  # a last partial group (K not a multiple of 128) is its own group
        m, k = x.shape
        pad = (-k) % 128
        g = torch.nn.functional.pad(x, (0, pad)).reshape(m, -1, 128)
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return ((g * reciprocal(s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
                * s).reshape(m, k + pad)[:, :k]
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    if acts == "fp8_token":
        s = s / FP8_MAX
        return (x * reciprocal(s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    if acts == "int8_token":
        s = s / 127.0
        return torch.round(x * reciprocal(s)).clamp(-128, 127) * s
    raise ValueError(f"unknown activation form {acts!r}")


def _dense(w: torch.Tensor) -> Built:
    """A dense checkpoint's weight, meaning itself (a bounded case's reference)."""
    return {"weight": w.clone()}, w


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm().clamp(min=1e-12)).item()


def bounded_slack(weight_bits: int, dynamic: bool) -> Callable[[torch.Tensor, torch.Tensor],
                                                               float]:
    """The error a method may add to x @ w^T when the suite cannot rebuild its grid: twice
    what symmetric round-to-nearest per output channel at `weight_bits` costs on these very
    operands (a per-group, asymmetric or finer method costs less), plus, for dynamic
    activations, twice the larger of 8-bit fp8 and int8 per-token quantization's cost. A
    wrong scale, layout or shard order is off by ~1; a half-bit slip passes."""
    qmax = 2.0 ** (weight_bits - 1) - 1

    def slack(x: torch.Tensor, w: torch.Tensor) -> float:
        x, w = x.float(), w.float()
        ref = x @ w.t()
        s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / qmax
        rtn = torch.round(w / s).clamp(-qmax - 1, qmax) * s
        err = _rel_err(x @ rtn.t(), ref)
        if dynamic:
            err += max(_rel_err(fake_quant_acts(x, a) @ w.t(), ref)
                       for a in ("fp8_token", "int8_token"))
        return 2.0 * err
    return slack


_EXACT_ONLINE = {"fp8_channel": "float", "int8_channel": "int"}  # what _online rebuilds


def online_cases(fmt: str, activations: str, weight_bits: int | None) -> tuple[RefCase, ...]:
    """The case of quantizing a dense checkpoint at load into `fmt` with `activations`
    ("dynamic" or "none", core.plan.quant_scheme.online_scheme): core's per-channel formats
    against the weights quantized as vLLM and SGLang do online (activations per token, or
    not at all); any other format against the dense product within `bounded_slack` (which
    needs `weight_bits`: no case without them)."""
    kind = _EXACT_ONLINE.get(fmt)
    if kind is not None and activations == "dynamic":
        return tuple(c for c in CASES if c.online and c.format == fmt)
    if kind is not None and activations == "none":
        return (RefCase(f"{fmt.split('_')[0]}-online-weight-only", fmt, None, _online(kind),
                        "none", online=True),)
    if weight_bits is None or activations not in ("dynamic", "none"):
        return ()
    acts = "a8" if activations == "dynamic" else "a16"
    return (RefCase(f"{fmt}-online-w{weight_bits}{acts}-bounded", fmt, None, _dense, "none",
                    online=True, slack=bounded_slack(weight_bits, activations == "dynamic")),)


def all_cases() -> tuple[RefCase, ...]:
    """The FP8/INT8 cases, MXFP4's, GGUF's, plus the INT4 ones where their reference module
    exists."""
    from conformance.quant_refs_gguf import CASES as GGUF
    from conformance.quant_refs_mxfp4 import CASES as MXFP4

    try:
        from conformance.quant_refs_int4 import CASES as INT4
    except ImportError:
        INT4 = ()
    # Weight-only: x is not quantized; K in whole groups, N in whole packed int32 words.
    return CASES + MXFP4 + GGUF + tuple(RefCase(c.name, c.format, c.config, c.build, "none", k_multiple=128,
                                 n_multiple=16) for c in INT4)
