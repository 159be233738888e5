"""Token embedding and the LM head (possibly tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.layers.linear import Matmul, Packer


class VocabEmbedding(nn.Module):
    """ids [T] -> [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in fp32; shares the embedding's weight if tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | None = None, tie_to: VocabEmbedding | None = None,
                 final_logit_softcap: float | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype,
                                                   device=device), requires_grad=False)
        self.final_logit_softcap = final_logit_softcap
        self._packed: torch.Tensor | None = None
        self._matmul: Matmul | None = None

    def repack(self, pack: Packer, matmul: Matmul) -> None:
        """Compute the product from a platform's packed weight (oneDNN's on a CPU: 2-3x faster
        than F.linear at decode shapes). Tied: a packed copy, since the embedding still looks up
        rows of the plain weight (vocab x hidden more elements of memory); untied: the weight
        is swapped."""
        packed = pack(self.weight)
        if packed is None:
            return
        if not self.tied:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self._packed, self._matmul = packed, matmul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            logits = self._matmul(hidden, weight=self._packed, bias=None).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
