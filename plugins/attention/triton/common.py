"""Shared pieces of the Triton attention kernels: launch configs, device facts, jit helpers.

Imported only by the backend factory (it imports triton). The numbers behind the configs live in
tuning.py (data only); this module turns them into configs for a device, dtype and head dim.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins._kit.triton_splitkv import (  # noqa: F401 - re-exported under their old home
    LOG2E,
    LOG2E_F,
    DecodeConfig,
    interpreting,
    num_kv_splits,
    sm_count,
)
from plugins.attention.triton import tuning


@functools.lru_cache(maxsize=16)
def cuda_capability(device: torch.device) -> int:
    """major*10+minor of `device` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@dataclass(frozen=True)
class ExtendConfig:
    """Tiling of the prefill/extend kernel."""

    block_m: int = 128  # query rows per program
    block_n: int = 64  # KV tokens per loop iteration
    num_warps: int = 8
    num_stages: int = 3
    # block_m rows = block_m / group positions x the query heads of one KV head, so each K/V
    # tile is loaded once per group (used when the group is a power of two dividing block_m)
    pack_gqa: bool = False
    # register cap per thread (ptxas maxnreg), None = the compiler's choice. At 128 an 8-warp
    # program leaves room for a second one on the SM (64K registers): the two run out of step,
    # so one's softmax overlaps the other's matrix multiplies.
    maxnreg: int | None = None

    def launch_options(self) -> dict:
        """num_warps / num_stages (and maxnreg when set) for a kernel launch or triton.Config."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts

    def packs(self, group: int) -> bool:
        """Whether this tiling packs a GQA group of `group` query heads per program."""
        return (self.pack_gqa and group > 1 and group & (group - 1) == 0
                and self.block_m % group == 0)


def arch_key(device: torch.device) -> str:
    """The tuning tables' arch key for `device`."""
    if torch.version.hip:
        return "rocm"
    return "sm90" if cuda_capability(device) >= 90 else "sm80"


def width_key(head_dim: int, v_dim: int, dtype: torch.dtype) -> str:
    """The tuning tables' width key: register/shared-memory footprint class of one tile."""
    d = max(head_dim, v_dim)
    if dtype == torch.float32 or d > 256:
        return "wide"
    return "d64" if d <= 64 else "d128" if d <= 128 else "d256"


def decode_config(head_dim: int, v_dim: int, dtype: torch.dtype,
                  device: torch.device) -> DecodeConfig:
    if interpreting():
        return DecodeConfig(*tuning.INTERPRET_DECODE, max_splits=4)
    return DecodeConfig(*tuning.DECODE[arch_key(device), width_key(head_dim, v_dim, dtype)])


def autotune_enabled() -> bool:
    """CORE_TRITON_AUTOTUNE=1 lets Triton's autotuner time the candidate tilings on the first
    call of each shape class. Off by default: the tables' first entries come from the H200 sweep
    (bench/sweep_triton.py), and autotuning while serving stalls the request that triggers it
    (~1 s for a new shape class, measured on the H200)."""
    return os.environ.get("CORE_TRITON_AUTOTUNE", "0").strip().lower() in ("1", "true", "yes",
                                                                           "on")


def extend_configs(head_dim: int, v_dim: int, dtype: torch.dtype,
                   device: torch.device) -> list[ExtendConfig]:
    """Candidate tilings, best guess first (the autotuner times them on the first call)."""
    if interpreting():
        return [ExtendConfig(*tuning.INTERPRET_EXTEND)]
    return [ExtendConfig(*t)
            for t in tuning.EXTEND[extend_table_key(head_dim, v_dim, dtype, device)]]


def extend_table_key(head_dim: int, v_dim: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[str, str]:
    """The (arch, width) key of the extend tuning tables for this problem."""
    return arch_key(device), width_key(head_dim, v_dim, dtype)


def small_extend_config(configs: list[ExtendConfig], programs_per_block_row: int,
                        max_extend_len: int, device: torch.device,
                        table_key: tuple[str, str] | None = None) -> ExtendConfig | None:
    """A smaller-block_m tiling when the first candidate leaves SMs idle, else None.

    programs_per_block_row = query heads x requests (one program each per block of new tokens).
    A short extension over a long prefix (e.g. 128 new tokens, one request) gets one block per
    head with block_m 128: halving block_m doubles the programs at the same K/V traffic per row.
    The tiling is tuning.EXTEND_SMALL[table_key] when the table has one, else block_m 64 with
    the first candidate's block_n.
    """
    first = configs[0]
    if first.block_m <= 64:
        return None
    # (a packed tiling has group x fewer programs per block row and group x more blocks: about
    # the same count)
    blocks = triton.cdiv(max_extend_len, first.block_m)
    if programs_per_block_row * blocks >= sm_count(device):
        return None
    tile = tuning.EXTEND_SMALL.get(table_key) if table_key else None
    return ExtendConfig(*tile) if tile else ExtendConfig(64, first.block_n, 4, first.num_stages)


@triton.jit
def softcap(s, cap):
    """cap * tanh(s / cap), written with exp so it runs everywhere (interpreter included)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x >= 0, t, -t)
