"""The runtime of GPUs that torch drives through `torch.cuda` (the `cuda` and `rocm` targets).

Both targets share it: a ROCm build of torch answers through torch.cuda too, with the same
streams, events, pinned memory and graphs (HIP graphs behind the CUDA names; declared for ROCm,
checked only on NVIDIA hardware here).
"""

from __future__ import annotations

from typing import Any

from core.contract.platform import BasePlatform, GraphSupport, MemoryDefaults, ModelGeometry

GiB = 2**30
GB = 10**9
MAX_RUNNING = 256  # default --max-running-requests on GPUs
# (device memory at least, prefill chunk in tokens): a bigger device affords bigger chunks
CHUNK_BY_MEMORY = ((90 * GiB, 16384), (40 * GiB, 8192), (20 * GiB, 4096), (0, 2048))
# (total device memory at least, largest captured decode batch): more memory, more concurrent
# decodes worth capturing. 120 GB (H200, B200, MI300X) captures up to MAX_RUNNING: an offline
# run there fills 256 decode slots, and steps past the largest graph run eagerly (Qwen3-30B-A3B
# offline 1,000 x 1,024/256 on an H200: 2,894 output tok/s with graphs to 160, 5,335 with graphs
# to 256, bench/RESULTS.md). 80 GB covers H100/A100-80G; the rest scale with the KV room.
MAX_BS_BY_MEMORY = ((120 * GB, 256), (80 * GB, 160), (40 * GB, 96), (20 * GB, 48), (0, 24))
BASE_RESERVE = 1 * GiB  # runtime context, library workspaces, allocator slack
# Extend shapes (requests, tokens each) compiled at startup: short and long extensions, one
# request and a batch (seconds at startup instead of in the first requests).
WARMUP_SHAPES = [(1, 16), (1, 1100), (64, 16), (8, 300)]


def default_graph_max_bs(total_memory_bytes: int) -> int:
    """--cuda-graph-max-bs when the user gave none, from the device's total memory."""
    if total_memory_bytes < 0:
        raise ValueError(f"total memory must be >= 0 bytes, got {total_memory_bytes}")
    return next(bs for floor, bs in MAX_BS_BY_MEMORY if total_memory_bytes >= floor)


def gpu_memory_defaults(total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
    """The chunk grows with memory; the static fraction leaves room for what is not static: the
    activations of one prefill chunk (the widest live tensors per token, twice over for the
    allocator) plus BASE_RESERVE. Graph memory is reserved separately."""
    chunk = next(c for floor, c in CHUNK_BY_MEMORY if total_bytes >= floor)
    inter = geometry.intermediate_size or 4 * geometry.hidden_size
    qkv = (geometry.num_heads + 2 * geometry.num_kv_heads) * geometry.head_dim
    per_token = (3 * inter + qkv + 4 * geometry.hidden_size) * geometry.dtype_bytes
    reserve = BASE_RESERVE + 2 * chunk * per_token
    fraction = round(min(0.9, max(0.5, 1 - reserve / max(total_bytes, 1))), 3)
    return MemoryDefaults(
        chunked_prefill_size=chunk, mem_fraction_static=fraction, max_running_requests=MAX_RUNNING,
        kv_cap_tokens=None, graph_max_bs=default_graph_max_bs(total_bytes),
        note=f"from {total_bytes / GiB:.0f} GiB of device memory: chunked prefill {chunk} "
             f"tokens, mem fraction {fraction} (keeps {reserve / GiB:.1f} GiB for activations)")


class _Event:
    """Waits for a copy queued on the current stream."""

    def __init__(self, event: Any):
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()


class TorchCudaPlatform(BasePlatform):
    """The Platform over torch.cuda (CUDA and ROCm builds of torch): memory-scaled defaults,
    pinned non-blocking copies with events, decode graphs, the overlap schedule, warm-up shapes.
    Devices "cuda:N", memory from torch.cuda.mem_get_info and the nccl binding are
    BasePlatform's defaults."""

    def memory_defaults(self, total_bytes: int, geometry: ModelGeometry) -> MemoryDefaults:
        return gpu_memory_defaults(total_bytes, geometry)

    def to_device(self, host: Any, device: Any) -> Any:
        # Pinned: a copy from pageable memory waits for the stream first (CUDA's rule), which
        # would stall the host until the previous step ends and defeat the overlap scheduler.
        return host.pin_memory().to(device, non_blocking=True)

    def copy_to_host(self, tensor: Any) -> tuple[Any, Any]:
        import torch

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, _Event(event)

    def synchronize(self, device: Any) -> None:
        import torch

        torch.cuda.synchronize(device)

    def graphs(self) -> GraphSupport:
        return GraphSupport(True)

    def graph_runner(self, runner: Any, sizes: Any, vocab_size: int) -> Any:
        from plugins.hardware.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner.for_runner(runner, sizes, vocab_size)

    def overlap_schedule(self) -> tuple[bool, str]:
        return True, ("overlap schedule on: decode step N+1 is launched before the host reads "
                      "step N's tokens")

    def warmup_shapes(self) -> list[tuple[int, int]]:
        return list(WARMUP_SHAPES)

    def dist_backend(self) -> str:
        return self.info.dist_backend or "nccl"
