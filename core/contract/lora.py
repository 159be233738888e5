"""The LoRA backend protocol (plugin kind `lora`, hook core_register_lora_backends, capabilities
core.contract.capabilities.LoRACaps): multi-LoRA serving, many adapters of one base model in
one batch.

The engine holds adapters in host memory and copies the ones a batch needs into a fixed number
of device slots. For every base projection an adapter may target it keeps stacked buffers
(`LoRAWeights`), zero where a slot's adapter leaves the projection out:

  a [slots, n_slices * R, in]   A of slot s, output slice j, in rows j*R .. j*R + rank
  b [slots, out, R]             B of slot s; rows of slice j are its part of the output
  scalings [slots] float32      lora_alpha / rank (alpha / sqrt(rank) with rslora)

R is --max-lora-rank; a smaller rank's rows and columns beyond it are zero. `output_slices`
are the widths of a fused projection's parts (q, k, v of qkv_proj; gate, up of gate_up_proj;
one slice for a plain projection), summing to `out`: slice j of the output gets
x @ A_j^T @ B_j^T, where A_j = a[s, j*R:(j+1)*R] and B_j = b[s, offset_j:offset_j+width_j].

The engine calls, from the model's forward (never concurrently):

- `prepare(batch: LoRABatch) -> meta`: once per step, before the forward. Whatever the
  backend needs per step (index tensors, segment tables), of its own type.
- `apply(x, y, weights, batch, meta) -> y`: for a projection with input x [T, in] and base
  output y [T, out] (same dtype), add scalings[s] * x_t @ A_j^T @ B_j^T to each token t's
  slice j, s being the slot of t's segment; tokens of segments whose slot is -1 (the base
  model) are left as they are. It may add in place and return y. x and y are contiguous in
  their last dim; T may be 0. y is whatever the base projection's quant method computed (dense,
  GGUF blocks, INT4, FP8, ...: LoRACaps.quant_methods names those a backend sits on); x is the
  projection's input as the model gave it, before any quantization of activations.

Tensor parallelism (LoRACaps.tensor_parallel): each rank's buffers hold its part, split like
the base layer (a column-parallel projection's b keeps the rank's output rows, `output_slices`
the rank's widths; a row-parallel one's a keeps the rank's input columns), and x, y are the
rank's: y is the partial sum before the layer's all-reduce. `apply` is the same arithmetic on
them; a backend that only reads the shapes it is given needs nothing more.

A backend must not assume segments are sorted by slot, that every slot appears, or that
segments are non-empty (a zero-length segment has no tokens).

Decode graphs (LoRACaps.graph_safe): a graph-safe backend's `prepare` and `apply` are captured
once per decode bucket and replayed with other adapters in the rows. Such a step's batch is
`device_only` (LoRABatch.on_device): one token per segment (seg_lens all 1; up to the largest
captured bucket, 256 tokens or more), each row's slot only in `seg_slots_t` (-1 for base
requests and for the bucket's padded rows), `seg_indptr` = 0, 1, ..., T. Its host lists
`seg_slots` and `ranks` hold no values (reading them raises): the values change from replay to
replay, the host never sees them. The backend reads only the token count and the device tensors,
launches grids sized by the token count, syncs nothing and allocates only what the step needs
afresh (a graph's pool keeps it). The stacked buffers are fixed tensors the engine writes in
place when it loads a slot, so a replay reads the adapters resident then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

BASE_SLOT = -1  # a segment of tokens served by the base model alone


@dataclass(frozen=True)
class LoRAConfig:
    """What a backend is built with."""

    num_slots: int  # adapters on the device at once (--max-loras-per-batch)
    max_rank: int  # R (--max-lora-rank)
    dtype: torch.dtype  # of activations and adapter buffers
    device: torch.device


@dataclass
class LoRABatch:
    """One step's tokens grouped into segments, each served by one adapter slot (or the base).

    Segments cover the step's T tokens in order: segment i is tokens
    [seg_starts[i], seg_starts[i] + seg_lens[i]). Host lists; `seg_indptr` [S + 1] int32 and
    `seg_slots_t` [S] int32 mirror them on the device for kernels. `ranks[s]` is the rank of
    the adapter in slot s (0: empty slot).
    """

    seg_lens: list[int]
    seg_slots: Sequence[int]
    ranks: Sequence[int]
    seg_indptr: torch.Tensor
    seg_slots_t: torch.Tensor
    # a decode graph's step: slots on the device only, host lists unreadable (module doc)
    device_only: bool = False

    @classmethod
    def on_device(cls, seg_indptr: torch.Tensor, seg_slots_t: torch.Tensor) -> LoRABatch:
        """A decode graph's step of T = len(seg_slots_t) tokens, one segment each: seg_indptr
        [T + 1] int32 = 0..T, seg_slots_t [T] int32 each row's slot (module doc)."""
        T = seg_slots_t.shape[0]
        return cls(seg_lens=[1] * T, seg_slots=OnDeviceOnly("seg_slots"),
                   ranks=OnDeviceOnly("ranks"), seg_indptr=seg_indptr, seg_slots_t=seg_slots_t,
                   device_only=True)

    @property
    def seg_starts(self) -> list[int]:
        starts, at = [], 0
        for n in self.seg_lens:
            starts.append(at)
            at += n
        return starts

    @property
    def num_tokens(self) -> int:
        return sum(self.seg_lens)


class OnDeviceOnly(Sequence[int]):
    """A device-only step's host list: its values live on the device and change between graph
    replays, so any read raises (a backend that would bake them into a graph fails loudly)."""

    def __init__(self, name: str):
        self.name = name

    def _refuse(self) -> NoReturn:
        raise RuntimeError(f"LoRABatch.{self.name} of a decode graph's step is not on the host "
                           f"(device_only: read seg_slots_t / seg_indptr; core.contract.lora)")

    def __len__(self) -> int:
        self._refuse()

    def __getitem__(self, i: Any) -> NoReturn:
        self._refuse()

    def __repr__(self) -> str:
        return f"OnDeviceOnly({self.name!r})"


@dataclass
class LoRAWeights:
    """One base projection's stacked adapter buffers (see the module doc for the layout)."""

    a: torch.Tensor  # [slots, n_slices * R, in]
    b: torch.Tensor  # [slots, out, R]
    scalings: torch.Tensor  # [slots] float32
    output_slices: tuple[int, ...]  # widths of the fused output's parts, summing to out
    max_rank: int  # R


@runtime_checkable
class LoRABackend(Protocol):
    """Adds adapter deltas to base projections' outputs (see the module doc)."""

    def prepare(self, batch: LoRABatch) -> Any:
        """Per-step metadata for `apply`, computed once before the forward."""
        ...

    def apply(self, x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights, batch: LoRABatch,
              meta: Any) -> torch.Tensor:
        """y [T, out] plus each token's adapter delta of x [T, in] (in place allowed)."""
        ...
