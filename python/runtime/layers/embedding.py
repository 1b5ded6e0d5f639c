"""Vocabulary embedding and LM head, sharded over the vocabulary for tensor parallelism.

Each tensor-parallel rank holds rows [start, start + rows) of the vocabulary (distributed.vocab_shard; rows
past the vocabulary are zero padding). The embedding looks up the ids of its rows, zeros the others and sums
over the ranks; the LM head computes its rows' logits, which the stage's first rank gathers and cuts to the
vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime import distributed
from radixgen.runtime.layers.linear import DENSE, LinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.shard, self.valid = distributed.vocab_shard(vocab_size, distributed.tp_size(),
                                                                     distributed.tp_rank())
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"embedding shape mismatch: expected {(self.vocab_size, param.shape[1])}, "
                             f"got {tuple(loaded.shape)}")
        param.data[:self.valid].copy_(loaded.narrow(0, self.start, self.valid))
        param.data[self.valid:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard == self.vocab_size:
            return F.embedding(ids, self.weight)
        # ids [start, start + valid) are this rank's; the others read row 0 and are zeroed, then summed
        mine = (ids >= self.start) & (ids < self.start + self.valid)
        out = F.embedding((ids - self.start) * mine, self.weight)
        return distributed.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))


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
        """This rank's logits (T, rows): `gather` makes the vocabulary's."""
        return self.method.apply(self, hidden)

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """(T, rows) float32 of every rank -> (T, vocab) on the stage's first rank, None on the others."""
        return distributed.gather_last_dim(logits, self.vocab_size)
