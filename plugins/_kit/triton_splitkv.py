"""Split-KV ("flash-decoding") pieces shared by the Triton decode kernels of the `triton` and
`triton_mla` attention backends: the split policy (how many KV splits a launch gets), each
split's token range, and stage 2, the merge of the splits' partial results by their
log2-sum-exp. Imports triton: imported only by backend factories.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Scores are exponentiated with exp2, so log2(e) is folded in. (A jit function may read a global
# only if it is a constexpr.)
LOG2E = tl.constexpr(1.4426950408889634)
LOG2E_F = 1.4426950408889634  # the same, for host code


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors, slowly: use tiny blocks)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on ROCm) of `device`; 8 on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the split-KV decode kernel (stage 1) and its split policy."""

    block_n: int = 64  # KV tokens per loop iteration
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 4  # aim for at least this many programs per SM
    min_split_tokens: int = 256  # a split never covers fewer tokens (short contexts split less)
    max_splits: int = 64  # grid size along the split axis (a power of two)


def num_kv_splits(batch_size: int, kv_heads: int, head_blocks: int, device: torch.device,
                  cfg: DecodeConfig, context: int | None = None) -> int:
    """Splits along the KV axis so that the grid fills every SM `cfg.waves` times over, with
    no split shorter than `cfg.min_split_tokens` of `context` (the longest context the step, or
    the captured graph, may see; None = no bound).

    The result is a launch-time constant: each program derives its own KV range from the
    device-side seq_lens, and a request shorter than splits x min_split_tokens uses fewer splits
    (the rest exit at once). So a CUDA graph captured with the split count of its largest context
    stays valid for every shorter one.
    """
    programs = max(1, batch_size * kv_heads * head_blocks)
    want = triton.cdiv(sm_count(device) * cfg.waves, programs)
    if context is not None:
        want = min(want, triton.cdiv(max(context, 1), cfg.min_split_tokens))
    return max(1, min(cfg.max_splits, triton.next_power_of_2(want)))


@triton.jit
def split_range(seq_len, split, num_splits, window, min_split, BLOCK_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr):
    """[lo, hi) of split `split`, and how many splits this request really uses."""
    start = 0
    if USE_WINDOW:  # the query sits at seq_len - 1 and sees `window` tokens, itself included
        start = tl.maximum(seq_len - window, 0)
    span = seq_len - start
    # Short contexts use fewer splits (at least min_split tokens each); the rest stay empty.
    used = tl.maximum(tl.minimum(num_splits, tl.cdiv(span, min_split)), 1)
    split_len = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    return lo, hi, used


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def merge_splits(
    part_o, part_lse, Out, seq_lens, Sinks, out_scale, window, num_splits, min_split,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, V_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    offs_dv = tl.arange(0, BLOCK_DV)
    omask = hmask[:, None] & (offs_dv < V_DIM)[None, :]
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # Only the splits stage 1 filled for this request are read (a short request in a graph
    # captured for long contexts uses few of them).
    _, _, used = split_range(seq_len, 0, num_splits, window, min_split, BLOCK_N, USE_WINDOW)
    if USE_SINKS:
        # the head's sink is one more split whose value is zero: lse = sink (log2 units)
        m = tl.load(Sinks + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
        w_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for split in range(0, used):
        lse = tl.load(part_lse + b * stride_lb + heads * stride_lh + split, mask=hmask,
                      other=float("-inf"))
        o = tl.load(part_o + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                    + offs_dv[None, :], mask=omask, other=0.0)
        m_new = tl.maximum(m, lse)
        # Split 0 is never empty, so m_new is finite from the first split on (masked heads
        # excepted: keep them finite to avoid inf - inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        w_sum = w_sum * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    out = acc * (out_scale / tl.where(w_sum > 0, w_sum, 1.0))[:, None]
    tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=omask)
