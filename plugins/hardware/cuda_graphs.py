"""Decode graphs on CUDA and ROCm (torch.cuda.CUDAGraph): the capture half of
core.contract.graphs.GraphRunner, which replays.

Every bucket is captured, largest first, into one shared memory pool, on a side stream after two
eager warm-up forwards (kernels compile and the allocator settles outside the capture). Over a
hybrid KV pool one graph holds every group's attention (the base class builds the groups' views).
"""

from __future__ import annotations

import torch

from core.contract.graphs import GraphRunner


class CudaGraphRunner(GraphRunner):
    """core.contract.graphs.GraphRunner with torch.cuda graph capture."""

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        # pinned, so the copy does not wait for the GPU (see the platform's to_device)
        return host.pin_memory()

    def capture(self) -> None:
        self.prepare_capture()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                batch = self.capture_batch(bs)  # every KV group's view with its metadata
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._forward(batch, bs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(batch, bs)
                self.graphs[bs] = graph
                self.batches[bs] = batch
        torch.cuda.synchronize(self.device)
