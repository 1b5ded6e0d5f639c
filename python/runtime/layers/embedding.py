"""Vocabulary embedding and LM head, sharded over the vocabulary for tensor parallelism.

Each tensor-parallel rank holds rows [start, start + rows) of the vocabulary (sharding.vocab_shard; rows
past the vocabulary are zero padding). The embedding looks up the ids of its rows, zeros the others and sums
over the ranks; the LM head computes its rows' logits, which the stage's first rank gathers and cuts to the
vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.ground import sharding
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelAxis
from radixgen.runtime.layers.linear import DENSE, ColumnParallelLinear, LinearBase, LinearMethod


class VocabParallelEmbedding(nn.Module):
    """A table of vocabulary rows; tied to an LM head (ParallelLMHead.tie) it has none of its own and reads the
    rows through the head's layout, which holds the one copy of the shared weight."""

    method: LinearMethod = DENSE  # how its own table is read: as loaded

    def __init__(self, vocab_size: int, hidden: int, *, tp: ParallelAxis = SINGLE.tp) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.start, self.shard, self.valid = sharding.vocab_shard(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @property
    def table(self) -> nn.Module:
        """The module whose weight holds the rows: this one, or the LM head it is tied to."""
        return self.__dict__.get("_tied_head") or self

    def weight_loader(self, param, loaded, shard_id=None):
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"embedding shape mismatch: expected {(self.vocab_size, param.shape[1])}, "
                             f"got {tuple(loaded.shape)}")
        param.data[:self.valid].copy_(loaded.narrow(0, self.start, self.valid))
        param.data[self.valid:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        if self.shard == self.vocab_size:
            return table.method.embed(table, ids)
        # ids [start, start + valid) are this rank's; the others read row 0 and are set to -0.0, then summed: x + -0.0
        # is x for every x (+0.0 would turn a -0.0 into +0.0), so the sum is the one rank's row, bit for bit
        mine = (ids >= self.start) & (ids < self.start + self.valid)
        out = table.method.embed(table, (ids - self.start) * mine)
        return self.tp.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), -0.0))


class ParallelLMHead(ColumnParallelLinear):
    """hidden -> this rank's vocabulary logits (T, rows), a linear layer over the vocabulary shard (so any linear
    method applies; `gather` makes the vocabulary's logits); tied, it is also the embedding's table."""

    tied = False

    def __init__(self, vocab_size: int, hidden: int, *, tp: ParallelAxis = SINGLE.tp) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.start, rows, self.valid = sharding.vocab_shard(vocab_size, tp.size, tp.rank)
        self.full_out, self.out_start = vocab_size, self.start
        LinearBase.__init__(self, hidden, rows, bias=False)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the weight with `embedding`: the checkpoint's embedding loads into this head (the model's
        load_weights renames it), and the embedding gives up its own table."""
        embedding.weight = None
        embedding.__dict__["_tied_head"] = self  # not a submodule: the model holds the head already
        self.tied = True

    def out_part(self, shard_id):
        return 0, self.start, self.valid, self.vocab_size

    def weight_loader(self, param, loaded, shard_id=None):
        """The rank's vocabulary rows; the padding rows past the vocabulary are zero."""
        super().weight_loader(param, loaded, shard_id)
        if param.output_dim is not None and self.valid < self.out_features:
            pack = param.output_pack
            param.data.narrow(param.output_dim, self.valid // pack, (self.out_features - self.valid) // pack).zero_()

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """(T, rows) float32 of every rank -> (T, vocab) on the stage's first rank, None on the others."""
        return self.tp.gather_first(logits, self.vocab_size)
