"""Token embedding and the LM head (possibly tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
