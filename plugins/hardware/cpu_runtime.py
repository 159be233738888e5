"""The runtime of the `cpu` target: host memory, CPU defaults, calloc'd KV buffers, and oneDNN
weight packing.

After loading, dense fp32 / bf16 weights (linear layers and the LM head) move to oneDNN's blocked
layout, which streams 1.4-1.9x faster than `F.linear` at the decode shapes (M = 1..16) and
1.1-1.4x at prefill (M = 512) on an AVX-512 CPU. bf16 packing needs oneDNN's bf16 support (an
AVX-512 BF16 or AMX CPU); elsewhere bf16 weights stay plain and `F.linear` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from core.contract.capabilities import c_compiler
from core.contract.platform import BasePlatform, GraphSupport, MemoryDefaults, ModelGeometry
from core.layers.linear import repack_dense_weights
from plugins.hardware.cpu import host_free_bytes

MAX_RUNNING = 64
KV_CAP_TOKENS = 32768  # host RAM is not the KV cache's to fill by default
CHUNK = 2048
FRACTION = 0.5
# decode graphs (plugins/hardware/cpu_graphs.py) for batches up to this: they remove the Python
# around the C calls, which matters while a step's arithmetic is small (bench/RESULTS.md)
GRAPH_MAX_BS = 8


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] -> oneDNN's blocked copy of it (an opaque `torch._mkldnn` tensor of the
    same shape and dtype, for `onednn_linear`), or None where that does not apply: not on a CPU,
    already packed, not fp32 / bf16, or no oneDNN (bf16: no bf16 support) in this torch build."""
    if weight.device.type != "cpu" or weight.is_mkldnn or weight.dim() != 2:
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    # No batch-size hint: one blocked layout serves every M (measured as fast as M-specific ones).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W packed by `onednn_pack` -> [..., out] in x's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_model(model: Any) -> int:
    """Pack every dense weight of a loaded model for oneDNN; returns how many are packed."""
    repack_dense_weights(model, onednn_pack, onednn_linear)
    return sum(1 for p in model.parameters() if p.is_mkldnn)


class CpuPlatform(BasePlatform):
    """The Platform of the host CPU: host memory, CPU defaults, KV buffers from calloc, oneDNN
    weight packing, decode graphs of recorded C calls (cpu_graphs.py). Nothing to copy, wait
    for or overlap; the device is the host ("cpu") and gloo its backend: BasePlatform's
    defaults."""

    def memory(self, index: int = 0) -> tuple[int, int]:
        return host_free_bytes(), int(self.info.memory_bytes)

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        # host memory is shared with every other process: the KV pool is what a model needs
        # (KV_CAP_TOKENS), within FRACTION of the memory available when the engine starts
        # (core.engine.memory.memory_pool.kv_pool_tokens), fewer tokens when that is short
        return MemoryDefaults(CHUNK, FRACTION, MAX_RUNNING, KV_CAP_TOKENS, GRAPH_MAX_BS,
                              f"CPU defaults: chunked prefill {CHUNK}, {MAX_RUNNING} running "
                              f"requests, KV pool {KV_CAP_TOKENS} tokens within {FRACTION} of "
                              "the host memory available (fewer when that is short), decode "
                              f"graphs up to batch {GRAPH_MAX_BS}")

    def zeros(self, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # calloc (through numpy): the OS maps zero pages as they are first touched, so a large
        # pool costs neither start-up time nor resident memory until its slots are used
        # (torch.zeros writes every byte up front).
        size = torch.empty((), dtype=dtype).element_size()
        raw = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
        return torch.from_numpy(np.zeros(tuple(shape), dtype=raw)).view(dtype)

    def to_device(self, host: Any, device: Any) -> Any:
        return host  # already there

    def copy_to_host(self, tensor: Any) -> tuple[Any, Any]:
        return tensor, None  # already there

    def graphs(self) -> GraphSupport:
        if c_compiler() is None:
            return GraphSupport(False, "CPU decode graphs replay through a compiled trampoline "
                                       "and no C compiler was found (cc, or $CC)")
        return GraphSupport(True)

    def graph_runner(self, runner: Any, sizes: Sequence[int], vocab_size: int) -> Any:
        from plugins.hardware.cpu_graphs import CpuGraphRunner

        return CpuGraphRunner.for_runner(runner, sizes, vocab_size)

    def post_load(self, model: Any) -> list[str]:
        dense = sum(1 for p in model.parameters()
                    if p.dim() == 2 and p.numel() and p.dtype.is_floating_point)
        n = pack_model(model)
        if n:
            return [f"cpu: {n} dense weights packed for oneDNN"]
        if not dense:
            return ["cpu: no dense weights to pack for oneDNN (the quant method keeps its own)"]
        return ["cpu: weights left plain (oneDNN cannot pack them in this build / dtype)"]

    def overlap_schedule(self) -> tuple[bool, str]:
        return False, ("overlap schedule off: a CPU computes while the host schedules, nothing "
                       "to overlap")
