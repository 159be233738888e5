"""Decode graph replay, the part a hardware plugin builds on: `GraphRunner`, the base class of a
Platform's graph runner (core.contract.platform.BasePlatform.graph_runner).

Static input buffers of the largest bucket; a bucket of size bs runs the model on views [:bs] of
them. A smaller batch is padded: padded rows decode token 0 at position 0 (seq_len 1) of request
row 0, writing their K/V into slot 0, which the KV pool reserves as a padding sink. Reading row
0's first slot is harmless (every table entry is a valid slot) and the padded rows' logits are
dropped. Batches above the largest bucket run eagerly.

A hybrid KV pool (core.engine.memory.kv_groups) is captured whole: each windowed group's new
slots are one more static input row; its view of the batch (its pool, its table, its backend
instance with the metadata of that instance's `prepare_for_graph`) shares the other static
tensors; padded rows write into slot 0 of every group (each group's pool keeps its own sink).
The tables are persistent tensors written before each replay, so pages a windowed group gives
back between replays (their entries pointed at its dummy page) are read as in eager decode.

LoRA adapters (core.engine.lora) with a graph-safe backend (LoRACaps.graph_safe) are captured
too: each row's adapter slot is one more static input row (-1: a base request, and every padded
row), and inside the captured forward the manager opens a device-only step over it and a static
seg_indptr (0..bs: one segment per token), so the backend's prepare and every projection's apply
are recorded. Every decode step replays these graphs, base-only ones too (their rows' slot -1:
the LoRA kernels still launch and skip every row). The adapters' stacked buffers are written in
place by slot loads, so a replay reads the adapters resident then. With a backend that is not
graph safe the graphs are captured with no step open (no delta) and only steps of base requests
replay them; ModelRunner.decode runs the others eagerly.

Capturing is the device's: a subclass implements `capture` (and `stage` where its copies want pinned memory), e.g.
plugins/hardware/cuda_graphs.py for CUDA and ROCm. Which sizes are captured and whether capture
happens at all is the engine's (core/engine/graphs.py).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.contract.lora import BASE_SLOT

if TYPE_CHECKING:
    from core.contract.attention import AttentionBackend
    from core.engine.lora import LoRAManager
    from core.engine.memory.kv_cache import KVPool
    from core.engine.memory.memory_pool import ReqToTokenPool
    from core.engine.model_runner import ModelRunner


class CapturedGraph(Protocol):
    """One bucket's captured decode forward (a torch.cuda.CUDAGraph, say)."""

    def replay(self) -> None:
        """Run the captured forward again over the static buffers' current values."""


def pick_bucket(batch_size: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= batch_size, or None when the batch is too big (run eagerly)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class GraphRunner:
    """Replays captured decode forwards with padded batches; `capture` is the device's."""

    # model: the model plugin's module (its forward, compute_logits and modules are called)
    def __init__(self, model: Any, backend: AttentionBackend, kv_pool: KVPool,
                 req_to_token: ReqToTokenPool, device: torch.device, sizes: Sequence[int],
                 vocab_size: int, group_pools: Sequence[KVPool] = (),
                 group_backends: Sequence[AttentionBackend] = (),
                 layer_group: Sequence[int] | None = None, lora: LoRAManager | None = None,
                 group_windows: Sequence[int | None] = ()):
        """group_pools, group_backends (decode backends), layer_group: a hybrid KV pool's
        windowed groups 1.. and each layer's group, as the ModelRunner holds them. lora: the
        runner's LoRA manager (its deltas are captured when its backend is graph safe)."""
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.group_pools = list(group_pools)
        self.group_backends = list(group_backends)
        self.layer_group = tuple(layer_group) if layer_group is not None else None
        # each windowed group's window: its decode never reads more keys than that
        self.group_windows = list(group_windows) or [None] * len(self.group_pools)
        # a runner built without a hybrid pool's groups would read group 0's table in every
        # layer: refused (capture_graphs then leaves decode eager and says why)
        if len(self.group_backends) != len(self.group_pools) or (
                bool(self.group_pools) != (self.layer_group is not None)) or (
                len(req_to_token.tables) != 1 + len(self.group_pools)):
            raise ValueError(f"graphs over a KV pool of {len(req_to_token.tables)} group(s) "
                             f"need each extra group's pool and decode backend and the layers' "
                             f"groups (GraphRunner.for_runner passes them)")
        self.device = device
        self.sizes = list(sizes)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.lora = lora
        # the packed row of each request's LoRA slot, when the graphs hold the adapters' deltas
        self.lora_row = 4 + len(self.group_pools) if lora is not None and lora.graph_safe \
            else None
        # [4 + extra groups (+ 1), max_bs]: input ids, positions, slots, table rows, then each
        # windowed group's slots, then the LoRA slots; one host->device copy per step.
        self.packed = torch.zeros(4 + len(self.group_pools) + (self.lora_row is not None), n,
                                  dtype=torch.long, device=device)
        # decode's LoRA segments: one per token (a bucket of bs reads [:bs + 1])
        self.lora_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.ones = torch.ones(n, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, CapturedGraph] = {}  # bucket -> captured graph
        self.batches: dict[int, ForwardBatch] = {}
        self.replays = 0

    @classmethod
    def for_runner(cls, runner: ModelRunner, sizes: Sequence[int], vocab_size: int
                   ) -> GraphRunner:
        """The graph runner of `runner` (core.engine.model_runner.ModelRunner): its model, decode
        backends, pools and tables, a hybrid pool's groups included, and its LoRA manager."""
        return cls(runner.model, runner.decode_backend, runner.kv_pool, runner.req_to_token,
                   runner.device, sizes, vocab_size, group_pools=runner.group_pools,
                   group_backends=[decode for _, decode in runner.group_backends],
                   layer_group=runner.layer_group, lora=runner.lora,
                   group_windows=getattr(runner, "group_windows", ()))

    @property
    def num_groups(self) -> int:
        return 1 + len(self.group_pools)

    @property
    def captures_lora(self) -> bool:
        """The graphs hold the LoRA path: steps serving adapters replay them too."""
        return self.lora_row is not None

    def can_run(self, batch_size: int) -> bool:
        return pick_bucket(batch_size, self.sizes) is not None

    def _batch(self, bs: int) -> ForwardBatch:
        ids, pos, loc, rows = (self.packed[i, :bs] for i in range(4))
        seq = self.seq_lens[:bs]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=ids, positions=pos, seq_lens=seq,
            prefix_lens=seq, extend_lens=self.ones[:bs], out_cache_loc=loc,
            req_pool_indices=rows, req_to_token=self.req_to_token.req_to_token,
            kv_pool=self.kv_pool, seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs, attn_backend=self.backend)
        if self.group_pools:  # each windowed group's view: its slots row, table, pool, backend
            views = [dataclasses.replace(batch, out_cache_loc=self.packed[4 + g, :bs],
                                         req_to_token=table, kv_pool=pool, attn_backend=be)
                     for g, (table, pool, be) in enumerate(zip(
                         self.req_to_token.tables[1:], self.group_pools, self.group_backends,
                         strict=True))]
            batch.groups = (batch, *views)
            batch.layer_group = self.layer_group
        return batch

    def capture_batch(self, bs: int) -> ForwardBatch:
        """The static decode batch of bucket `bs`, every group's view with the metadata of its
        backend's prepare_for_graph: what `capture` records a forward of."""
        batch = self._batch(bs)
        for view in batch.groups or (batch,):
            view.attn_meta = view.attn_backend.prepare_for_graph(view, bs)
        return batch

    def _forward(self, batch: ForwardBatch, bs: int) -> None:
        # seq_lens (prefix_lens aliases them: decode backends do not read those) follow from positions
        # inside the graph, so a replay needs only the packed copy.
        self.seq_lens[:bs].copy_(batch.positions + 1)
        lora = self.lora
        if lora is not None:
            if self.lora_row is not None:  # prepare + every projection's apply are recorded
                lora.begin_graph_step(self.lora_indptr[:bs + 1],
                                      self.packed[self.lora_row, :bs].to(torch.int32))
            else:  # graphs of base steps: no delta recorded, whatever the last step was
                lora.end_step()
        try:
            hidden = self.model.forward(batch.input_ids, batch.positions, batch)  # [bs, H]
            self.logits[:bs].copy_(self.model.compute_logits(hidden))  # [bs, V] fp32
        finally:
            if lora is not None:
                lora.end_step()

    def capture(self) -> None:
        """Capture every bucket into self.graphs (each value has `replay()`)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture: a Platform's graph "
                                  "runner implements capture()")

    def prepare_capture(self) -> None:
        """What every capture starts with: rotary tables grown to the whole context (lookups past
        their end would sync the host), the backend's graph state, every row a padded row."""
        for m in self.model.modules():
            if hasattr(m, "cover_all_positions"):
                m.cover_all_positions()
        full = self.req_to_token.max_context
        # a windowed group's splits are sized for its window (a few hundred or thousand keys),
        # not for the whole context: any split count is correct, extra ones only cost launches
        for backend, window in zip((self.backend, *self.group_backends),
                                   (None, *self.group_windows), strict=True):
            backend.init_graph_state(self.max_bs, min(full, window + 1) if window else full)
        self.packed.zero_()
        if self.lora_row is not None:
            self.packed[self.lora_row].fill_(BASE_SLOT)

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        """The host copy of the packed inputs as the device's copy wants it (CUDA: pinned, so
        the copy does not wait for the device)."""
        return host

    def decode(self, rows: Sequence[int], input_ids: Sequence[int] | torch.Tensor,
               positions: Sequence[int], slots: Sequence[int],
               group_slots: Sequence[Sequence[int]] = (),
               lora: Sequence[int] | None = None) -> torch.Tensor:
        """Same contract as ModelRunner.decode -> logits [B, V] (a view, valid until the next
        decode). group_slots[g - 1][i]: request i's new slot in windowed group g. lora: each
        request's LoRA slot (None: the base for all); adapters only where captures_lora."""
        B = len(rows)
        bs = pick_bucket(B, self.sizes)
        if bs is None:
            raise ValueError(f"batch of {B} is larger than the largest captured graph "
                             f"({self.max_bs}); run it eagerly")
        if len(group_slots) != len(self.group_pools):
            raise ValueError(f"{len(group_slots)} groups' slots for graphs over "
                             f"{self.num_groups} KV groups")
        if self.lora_row is not None:
            lora = [BASE_SLOT] * B if lora is None else lora
        elif lora is not None and any(s != BASE_SLOT for s in lora):
            raise ValueError("these decode graphs hold no LoRA deltas (captured without a "
                             "graph-safe LoRA backend); run adapter steps eagerly")
        else:
            lora = None
        on_device = isinstance(input_ids, torch.Tensor)  # overlap: last step's tokens
        host = torch.tensor(padded_inputs(rows, [0] * B if on_device else input_ids, positions,
                                          slots, bs, group_slots, lora),
                            dtype=torch.long)  # [4 + extra groups (+ 1), bs]
        self.packed[:, :bs].copy_(self.stage(host), non_blocking=True)
        if on_device:
            self.packed[0, :B].copy_(input_ids)
        real = self.packed[:, :B]
        # The real rows' new slots into every group's table, outside the graph: a padded row
        # must never write into row 0's entries.
        for g, table in enumerate(self.req_to_token.tables):
            table[real[3], real[1]] = real[2 if g == 0 else 3 + g].to(torch.int32)
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[:B]


def padded_inputs(rows: Sequence[int], input_ids: Sequence[int], positions: Sequence[int],
                  slots: Sequence[int], bs: int, group_slots: Sequence[Sequence[int]] = (),
                  lora: Sequence[int] | None = None) -> list[list[int]]:
    """The [4 + len(group_slots) (+ 1 with `lora`), bs] rows GraphRunner copies in: real
    entries, then padding (token 0, position 0, slot 0 = the sink, table row 0; slot 0 in every
    windowed group too; LoRA slot -1, the base: no delta). Exposed for tests."""
    pad = bs - len(rows)
    if pad < 0:
        raise ValueError(f"batch of {len(rows)} does not fit a bucket of {bs}")
    out = [[*input_ids, *[0] * pad], [*positions, *[0] * pad], [*slots, *[0] * pad],
           [*rows, *[0] * pad], *([*gs, *[0] * pad] for gs in group_slots)]
    if lora is not None:
        out.append([*lora, *[BASE_SLOT] * pad])
    return out
