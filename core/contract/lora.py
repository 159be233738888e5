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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
    seg_slots: list[int]
    ranks: Sequence[int]
    seg_indptr: torch.Tensor
    seg_slots_t: torch.Tensor

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
