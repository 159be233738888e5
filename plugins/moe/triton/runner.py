"""`triton` MoE runner: routing (core.contract.moe), a sort of the (token, slot) rows by expert, then
the two grouped-GEMM kernels of `kernels.py` and a fixed-order sum of each token's k rows."""

from __future__ import annotations

import functools
import os

import torch

from core.contract.moe import (
    ACTIVATIONS,
    MoELayerParams,
    MoERunner,
    MoEWeights,
    expert_biases,
    route,
)
from plugins.moe.triton import kernels, routing, tuning


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the N = T * k rows (row a = token * k + slot) by expert, each expert's group padded
    to a multiple of block_m with the id N. Sizes depend only on N, E and block_m, and nothing
    is read back to the host (graph safe).

    ids [T, k] -> (sorted_ids [P] int32, block_expert [P / block_m] int32, total [1] int64),
    P = the worst-case padded length, total = the padded length of this routing.
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(n, device=device) - start[sorted_expert]
    # at most min(N, E) experts have rows, each padding fewer than block_m
    worst = n + min(n, num_experts) * (block_m - 1)
    worst = (worst + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((worst,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, worst, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:]


# Steps of up to this many tokens sum each token's k rows in the down kernel (one launch less).
FUSE_SUM_TOKENS = 16
_LOCKS: dict[torch.device, torch.Tensor] = {}


def _locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 counts, one per column of down tiles, zero between calls (each call's
    last program of a column resets it). One table serves every layer: a stream runs its calls
    in order. Made on the first (eager, warm-up) call, before any graph is captured."""
    t = _LOCKS.get(device)
    if t is None or t.numel() < tiles:
        t = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _LOCKS[device] = t
    return t


# see forward: the largest row tile fp8 block experts run on
FP8_MAX_BLOCK_M = 32
MXFP4_DOTS = ("auto", "scaled", "decode")
# tl.dot_scaled's x format per compute dtype (fp32 has none: the decode path)
_MX_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _scale_strides(scale: torch.Tensor, scaled: bool) -> tuple[int, int, int]:
    """(expert, output-block, K-block) strides of an fp8 block scale [E, N/bn, K/bk] or an
    mxfp4 one [E, N, K/32]."""
    return (scale.stride(0), scale.stride(1), scale.stride(2)) if scaled else (0, 0, 0)


def _bias_args(bias: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pointer, expert stride) of a per-expert bias [E, N] (None: an unused pointer)."""
    if bias is None:
        return dummy, 0
    if bias.stride(-1) != 1:
        raise ValueError("the triton MoE runner needs expert biases contiguous in their last "
                         "dim")
    return bias, bias.stride(0)


@functools.lru_cache(maxsize=16)
def _arch(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpreter"
    if torch.version.hip:
        return "rocm"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


class TritonMoE(MoERunner):
    """Fused MoE in two Triton kernels (see kernels.py); routing weights fp32."""

    def __init__(self, tiling: tuning.Tiling | None = None, mxfp4_dot: str = "auto"):
        """tiling: force one (block_m, block_n, block_k, warps, stages) for every call (the
        sweep in bench/ does); None: the tuning table's pick per call. mxfp4_dot: how mxfp4
        experts are multiplied (kernels.py): "scaled" (tl.dot_scaled; bf16 / fp16 only),
        "decode" (tiles decoded in registers, then tl.dot; any dtype), "auto": scaled for
        bf16 / fp16, decode for fp32."""
        if mxfp4_dot not in MXFP4_DOTS:
            raise ValueError(f"mxfp4_dot must be one of {MXFP4_DOTS}, not {mxfp4_dot!r}")
        if os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available():
            raise RuntimeError("the triton MoE runner needs a GPU (or TRITON_INTERPRET=1 for "
                               "tests)")
        self.tiling = tiling
        self.mxfp4_dot = mxfp4_dot

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, weights: MoEWeights,
                layer: MoELayerParams, shared: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        fp8 = weights.form == "fp8"
        mxfp4 = weights.form == "mxfp4"
        if weights.form not in ("unquantized", "fp8", "mxfp4"):
            raise ValueError(f"the triton MoE runner runs unquantized, fp8 and mxfp4 experts, "
                             f"not {weights.form}")
        if fp8 and "block" not in weights.extra:
            raise ValueError("the triton MoE runner runs block-scaled fp8 experts only (per-"
                             "channel fp8 experts: torch_native)")
        if layer.activation not in ACTIVATIONS:
            raise ValueError(f"the triton MoE runner fuses {', '.join(ACTIVATIONS)}, not "
                             f"{layer.activation}")
        w13, w2 = weights.w13, weights.w2
        if w13.stride(-1) != 1 or w2.stride(-1) != 1:  # the kernels step the last dim by 1
            raise ValueError("the triton MoE runner needs w13 / w2 contiguous in their last dim")
        T, H = hidden.shape
        E, two_i, _ = w13.shape
        inter = two_i // 2
        k = layer.top_k
        n = T * k
        arch = _arch(hidden.device)
        block_m, block_n, block_k, warps, stages = self.tiling or tuning.fit_dtype(
            tuning.pick(arch, n / E), hidden.element_size(), arch)
        scale_n = 1
        w13_s = w2_s = w13  # unused pointers when not fp8 / mxfp4
        # expert biases (GPT-OSS's; any form): fp32 [E, N], added in both kernels' epilogues
        biases = expert_biases(weights)
        w13_b, w2_b = biases if biases is not None else (None, None)
        if mxfp4:  # e8m0 bytes [E, N, K/32]
            w13_s, w2_s = weights.extra["w13_scale"], weights.extra["w2_scale"]
        mx_dot = ""
        if mxfp4 and self.mxfp4_dot != "decode":
            mx_dot = _MX_FORMAT.get(hidden.dtype, "")
            if not mx_dot and self.mxfp4_dot == "scaled":
                raise ValueError(f"mxfp4_dot='scaled' multiplies bf16 / fp16 activations, not "
                                 f"{hidden.dtype}")
            # one K step is whole scale groups, and at least two (a [N, 1] scale tile is not
            # a dot operand everywhere)
            block_k = max(block_k, 64)
        if fp8:  # a K step is one scale block: BLOCK_K is the block's K
            scale_n, block_k = (int(b) for b in weights.extra["block"].tolist())
            # Row tiles of 64 or more (Hopper's wgmma path) gave wrong fp8 products on the H200
            # (triton 3.6; fp32 compute: 2e-3 relative error at 64 rows against 3e-7 at 16 and
            # 32, the quant suite's MoE-experts case): fp8 experts stay on 16 / 32-row tiles.
            block_m = min(block_m, FP8_MAX_BLOCK_M)
            if inter % scale_n:
                raise ValueError(f"intermediate size {inter} is not a multiple of the fp8 "
                                 f"scale block {scale_n}")
            w13_s, w2_s = weights.extra["w13_scale"], weights.extra["w2_scale"]
        # Routing in the Triton routing kernels (a correction bias or not); grouped top-k
        # (DeepSeek's, noaux_tc's top-2-sum groups included) there for decode-sized steps, by
        # select_experts in PyTorch for larger ones
        bias = layer.correction_bias
        if routing.can_route_align(T, E, k, layer.grouped_topk):  # decode: 1 launch
            route_w, ids, sorted_ids, block_expert, total = routing.route_and_align(
                router_logits, k, layer.renormalize, layer.scoring_func,
                layer.routed_scaling_factor, block_m, bias, layer.grouped_topk)
        else:
            if layer.grouped_topk is None and E <= routing.MAX_TOPK_EXPERTS:
                route_w, ids = routing.fused_topk(router_logits, k, layer.renormalize,
                                                  layer.scoring_func,
                                                  layer.routed_scaling_factor, bias)
            else:
                route_w, ids = route(router_logits, layer)  # [T, k] fp32, [T, k] int64
            if n <= routing.MAX_ALIGN_ROWS and E <= routing.MAX_ALIGN_EXPERTS:
                sorted_ids, block_expert, total = routing.fused_align(ids, E, block_m)
            else:
                sorted_ids, block_expert, total = align_by_expert(ids.long(), E, block_m)
        # The grid covers the worst case (graph safe); under the interpreter (CPU tensors, tests
        # only) a host read of the real count spares it the idle programs.
        blocks = (sorted_ids.numel() if hidden.device.type != "cpu" else int(total)) // block_m
        # fp32: IEEE dots (TF32 would miss the fp32 tolerance); half types: the target's default
        precision = "ieee" if hidden.dtype == torch.float32 and not fp8 else None
        x = hidden.contiguous()
        launch = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "PRECISION": precision, "FP8_BLOCK": fp8, "SCALE_N": scale_n,
                  "MXFP4": mxfp4, "HAS_BIAS": w13_b is not None, "MX_DOT": mx_dot,
                  "num_warps": warps, "num_stages": stages}
        glu = {"ACTIVATION": layer.activation}

        inter_rows = torch.empty(n, inter, dtype=hidden.dtype, device=hidden.device)
        kernels.gate_up_kernel[kernels.grid(blocks, inter, block_n)](
            x, w13, inter_rows, sorted_ids, block_expert, total, n, H, inter, k,
            x.stride(0), w13.stride(0), w13.stride(1), inter_rows.stride(0),
            w13_s, *_scale_strides(w13_s, fp8 or mxfp4), *_bias_args(w13_b, w13),
            float(layer.swiglu_alpha), float(layer.swiglu_limit), **launch, **glu)
        partial = torch.empty(n, H, dtype=hidden.dtype, device=hidden.device)
        if out is None:
            out = torch.empty_like(hidden)
        # decode-sized steps: the down kernel's last programs sum the k rows (+ shared) too
        fuse = T <= FUSE_SUM_TOKENS and out.stride(-1) == 1 and (
            shared is None or shared.stride(-1) == 1)
        tiles_n = kernels.grid(blocks, H, block_n)[1]
        locks = _locks(hidden.device, tiles_n) if fuse else partial
        kernels.down_kernel[kernels.grid(blocks, H, block_n)](
            inter_rows, w2, partial, route_w.reshape(-1), sorted_ids, block_expert, total, n,
            H, inter, inter_rows.stride(0), w2.stride(0), w2.stride(1), partial.stride(0),
            w2_s, *_scale_strides(w2_s, fp8 or mxfp4), *_bias_args(w2_b, w2), out,
            shared if shared is not None else out,
            locks, k, out.stride(0), shared.stride(0) if shared is not None else 0,
            FUSE_SUM=fuse, HAS_SHARED=shared is not None, **launch)
        if fuse:
            return out
        rows = partial.view(T, k, H)
        if k == 1:
            out.copy_(rows[:, 0])
        else:
            torch.sum(rows, dim=1, out=out)
        if shared is not None:
            out.add_(shared)
        return out
