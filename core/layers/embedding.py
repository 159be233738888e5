"""Token embedding and the LM head (possibly tied to it).

A quant method's `load_table(module, tensor)` (core.contract.quant) may keep either weight in its
own form: the module then looks rows up with `table.rows(ids, dtype)` and computes logits with
`table.logits(hidden)`, and its dense `weight` is left empty ([0, hidden]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.engine.distributed import SINGLE, TPGroup
from core.layers.linear import Matmul, Packer, tp_narrow


def _vocab_part(module: nn.Module, loaded: object) -> object:
    """This rank's rows of a [vocab, hidden] checkpoint tensor; the last shard's rows past the
    vocabulary are zeros (a dense tensor then: quantized blocks cannot be padded)."""
    tp = module.tp
    if tp.size == 1:
        return loaded
    start, rows = tp.vocab_part(module.vocab_size)
    have = max(0, min(rows, module.vocab_size - start))
    if have == rows:
        return tp_narrow(loaded, 0, start, rows)
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.dequantize()
    part = loaded.new_zeros(rows, loaded.shape[-1])
    part[:have] = loaded[start:start + have]
    return part


def _load_table(module: nn.Module, param: nn.Parameter, loaded: object) -> None:
    """The weight_loader of the embedding and the LM head: the quant method's table, or a
    dense copy."""
    method = module.table_method  # None: a layer built without a quant method
    table = method.load_table(module, loaded) if method is not None else None
    if table is not None:
        module.table = table
        param.data = torch.empty(0, param.shape[-1], dtype=param.dtype, device=param.device)
        return
    if isinstance(loaded, torch.Tensor):
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded)
        return
    dequantize = getattr(loaded, "dequantize", None)  # blocks no method took: made dense
    if dequantize is None:
        raise ValueError(f"cannot load {type(loaded).__name__} into a dense weight")
    _load_table(module, param, dequantize())


class VocabEmbedding(nn.Module):
    """ids [T] -> [T, hidden]. Vocab-parallel under tensor parallelism: this rank holds
    rows [start, start + rows) (core.engine.distributed.TPGroup.vocab_part), looks up the ids that fall
    there, zeros the others, and the ranks' lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | None = None, quant_method: object = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.tp = tp
        self.vocab_start, rows = tp.vocab_part(vocab_size) if tp.active else (0, vocab_size)
        self.vocab_rows = rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.table_method = quant_method  # not `quant_method`: not a linear's owner
        self.table = None  # the quant method's form of the weight, once loaded

    def weight_loader(self, param: nn.Parameter, loaded: object, shard: str | None = None
                      ) -> None:
        _load_table(self, param, _vocab_part(self, loaded))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return self._lookup(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)  # [T]
        h = self._lookup(torch.where(inside, local, torch.zeros_like(local)))
        h = h * inside.unsqueeze(-1).to(h.dtype)  # [T, hidden], zero for other ranks' ids
        return self.tp.all_reduce(h)


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in fp32; shares the embedding's weight if tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | None = None, tie_to: VocabEmbedding | None = None,
                 final_logit_softcap: float | None = None, quant_method: object = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp  # vocab-parallel: this rank's logits, all-gathered (as the embedding)
        rows = tp.vocab_part(vocab_size)[1] if tp.active else vocab_size
        self.tied = tie_to is not None
        self.table_method = quant_method  # not `quant_method`: not a linear's owner
        self.table = None  # the quant method's form of an untied weight, once loaded
        self._tied_to = (tie_to,) if tie_to is not None else ()  # not a submodule
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype,
                                                   device=device), requires_grad=False)
        self.final_logit_softcap = final_logit_softcap
        self._packed: torch.Tensor | None = None
        self._matmul: Matmul | None = None

    def repack(self, pack: Packer, matmul: Matmul) -> None:
        """Compute the product from a platform's packed weight (oneDNN's on a CPU: 2-3x faster
        than F.linear at decode shapes). Tied: a packed copy, since the embedding still looks up
        rows of the plain weight (vocab x hidden more elements of memory); untied: the weight
        is swapped. Nothing to do for a weight a quant method keeps as a table."""
        if self._table() is not None:
            return
        packed = pack(self.weight)
        if packed is None:
            return
        if not self.tied:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self._packed, self._matmul = packed, matmul

    def weight_loader(self, param: nn.Parameter, loaded: object, shard: str | None = None
                      ) -> None:
        _load_table(self, param, _vocab_part(self, loaded))

    def _table(self) -> object:
        return self._tied_to[0].table if self._tied_to else self.table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        table = self._table()
        if table is not None:
            logits = table.logits(hidden)
        elif self._packed is not None:
            logits = self._matmul(hidden, weight=self._packed, bias=None).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.tp.active:  # [N, rows] per rank -> [N, vocab]
            logits = self.tp.all_gather_last(logits)[:, :self.vocab_size]
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
