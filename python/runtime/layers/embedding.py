"""Vocabulary embedding and LM head, sharded over the vocabulary for tensor parallelism (tp 1 now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.layers.linear import DENSE, LinearMethod, TPInfo


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = vocab_size // TPInfo.size
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        part = loaded.narrow(0, TPInfo.rank * self.shard, self.shard)
        if part.shape != param.shape:
            raise ValueError(f"embedding shape mismatch: expected {tuple(param.shape)}, got {tuple(part.shape)}")
        param.data.copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> vocabulary logits; shares the embedding's weight when the model ties them."""

    packed: torch.Tensor | None = None
    bias = None
    method: LinearMethod = DENSE

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def set_linear_method(self, method: LinearMethod) -> None:
        """As LinearBase's: the (possibly tied) weight applied by `method`."""
        self.method = method
        method.process_weights(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden)
