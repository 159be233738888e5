"""Shared pieces of the Triton attention kernels: launch configs, device facts, jit helpers.

Imported only by the backend factory (it imports triton).
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


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors, slowly: use tiny blocks)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on ROCm) of `device`; 8 on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@functools.lru_cache(maxsize=16)
def cuda_capability(device: torch.device) -> int:
    """major*10+minor of `device` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the split-KV decode kernel (stage 1)."""

    block_n: int = 64  # KV tokens per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    min_split_tokens: int = 256  # a split never covers fewer tokens (short contexts split less)
    max_splits: int = 64  # grid size along the split axis (a power of two)
    waves: int = 4  # aim for at least this many programs per SM


@dataclass(frozen=True)
class ExtendConfig:
    """Tiling of the prefill/extend kernel."""

    block_m: int = 128  # query rows per program
    block_n: int = 64  # KV tokens per loop iteration
    num_warps: int = 8
    num_stages: int = 3


def decode_config(head_dim: int, v_dim: int, dtype: torch.dtype,
                  device: torch.device) -> DecodeConfig:
    if interpreting():
        return DecodeConfig(block_n=32, num_warps=1, num_stages=1, min_split_tokens=32,
                            max_splits=4, waves=1)
    big = max(head_dim, v_dim) > 128 or dtype == torch.float32
    return DecodeConfig(block_n=32 if big else 64, num_warps=4, num_stages=2 if big else 3)


def autotune_enabled() -> bool:
    """CORE_TRITON_AUTOTUNE=0 pins the first candidate tiling (quicker start, e.g. in tests)."""
    return os.environ.get("CORE_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no",
                                                                               "off")


def extend_configs(head_dim: int, v_dim: int, dtype: torch.dtype,
                   device: torch.device) -> list[ExtendConfig]:
    """Candidate tilings, best guess first (the autotuner times them on the first call)."""
    if interpreting():
        return [ExtendConfig(block_m=32, block_n=32, num_warps=1, num_stages=1)]
    d = max(head_dim, v_dim)
    if torch.version.hip:  # 64 KB of LDS per CU: small tiles, no multi-buffering (untested)
        return [ExtendConfig(64, 64, 4, 1), ExtendConfig(64, 32, 4, 1), ExtendConfig(32, 32, 4, 1)]
    hopper = cuda_capability(device) >= 90
    if dtype == torch.float32 or d > 128:
        # (64, 64) needs 213 KB of shared memory for fp32 at d=256: more than sm80 has.
        wide = [ExtendConfig(64, 64, 8, 2)] if hopper else []
        return [ExtendConfig(64, 32, 4, 2), *wide, ExtendConfig(32, 32, 4, 2)]
    if d <= 64:
        return [ExtendConfig(128, 64, 4, 3), ExtendConfig(128, 128, 8, 3),
                ExtendConfig(64, 64, 4, 3), ExtendConfig(128, 64, 8, 4)]
    cfgs = [ExtendConfig(128, 64, 8, 3), ExtendConfig(128, 128, 8, 3),
            ExtendConfig(128, 64, 4, 3), ExtendConfig(64, 64, 4, 3), ExtendConfig(128, 32, 4, 4)]
    if not hopper:  # sm80/sm86 have less shared memory: the 128x128 tile is a poor first guess
        cfgs = [ExtendConfig(128, 64, 4, 3), ExtendConfig(64, 64, 4, 3), ExtendConfig(128, 32, 4, 3)]
    return cfgs


def num_kv_splits(batch_size: int, kv_heads: int, head_blocks: int, device: torch.device,
                  cfg: DecodeConfig) -> int:
    """Splits along the KV axis so that the grid fills every SM `cfg.waves` times over.

    It depends on the batch shape only (never on sequence lengths), so a decode step captured in a
    CUDA graph keeps a valid grid for any context length; each program derives its own KV range
    from the device-side seq_lens, and splits left empty by a short context exit at once.
    """
    programs = max(1, batch_size * kv_heads * head_blocks)
    want = triton.cdiv(sm_count(device) * cfg.waves, programs)
    return max(1, min(cfg.max_splits, triton.next_power_of_2(want)))


@triton.jit
def softcap(s, cap):
    """cap * tanh(s / cap), written with exp so it runs everywhere (interpreter included)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x >= 0, t, -t)
