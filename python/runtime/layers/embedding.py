"""Vocabulary embedding and LM head, sharded over the vocabulary for tensor parallelism (tp 1 now)."""

from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.layers.linear import DENSE, ColumnParallelLinear, LinearMethod, TPInfo


class VocabParallelEmbedding(nn.Module):
    """A table of vocabulary rows; tied to an LM head (ParallelLMHead.tie) it has none of its own and reads the
    rows through the head's layout, which holds the one copy of the shared weight."""

    method: LinearMethod = DENSE  # how its own table is read: as loaded

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = vocab_size // TPInfo.size
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @property
    def table(self) -> nn.Module:
        """The module whose weight holds the rows: this one, or the LM head it is tied to."""
        return self.__dict__.get("_tied_head") or self

    def weight_loader(self, param, loaded, shard_id=None):
        part = loaded.narrow(0, TPInfo.rank * self.shard, self.shard)
        if part.shape != param.shape:
            raise ValueError(f"embedding shape mismatch: expected {tuple(param.shape)}, got {tuple(part.shape)}")
        param.data.copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        return table.method.embed(table, ids)


class ParallelLMHead(ColumnParallelLinear):
    """hidden -> vocabulary logits, a linear layer over the vocabulary shard (so any linear method applies); tied,
    it is also the embedding's table."""

    tied = False

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(hidden, vocab_size, bias=False)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the weight with `embedding`: the checkpoint's embedding loads into this head (the model's
        load_weights renames it), and the embedding gives up its own table."""
        embedding.weight = None
        embedding.__dict__["_tied_head"] = self  # not a submodule: the model holds the head already
        self.tied = True
