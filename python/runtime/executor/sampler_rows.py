"""The sampler's per-row reductions (log-softmax, sums, running sums, argmax): torch's, or the batch-invariant
kernels' for the deterministic mode on CUDA (executor/sampler.py takes either as its `rows`)."""

from __future__ import annotations

import torch
from torch import Tensor


class TorchRows:
    """The sampler's per-row reductions as torch ops. On CUDA their launch shape (and for cumsum, the algorithm)
    follows the row count, so the deterministic mode there takes BatchInvariantRows instead."""

    whole_rows = False  # draw over the whole row always (never among candidates, which sum in another order)

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        return torch.log_softmax(x, dim=-1)

    @staticmethod
    def sum(x: Tensor) -> Tensor:
        return x.sum(dim=-1)

    @staticmethod
    def cumsum(x: Tensor) -> Tensor:
        return x.cumsum(-1)

    @staticmethod
    def cumsum_(x: Tensor) -> Tensor:
        return x.cumsum_(-1)

    @staticmethod
    def argmax(x: Tensor) -> Tensor:
        return x.argmax(dim=-1)


class BatchInvariantRows(TorchRows):
    """radixgen.kernels.batch_invariant's row kernels (one program per row, fixed blocks from column 0): a row's
    logprobs, mass and running sums do not depend on the other rows. Draws always run over the whole row, whose
    running sums do not depend on which path (candidates or whole row) the batch's other rows send it down."""

    whole_rows = True

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        from radixgen.kernels.batch_invariant import row_log_softmax

        return row_log_softmax(x.contiguous())

    @staticmethod
    def sum(x: Tensor) -> Tensor:
        from radixgen.kernels.batch_invariant import row_sum

        return row_sum(x.contiguous())

    @staticmethod
    def cumsum(x: Tensor) -> Tensor:
        from radixgen.kernels.batch_invariant import row_cumsum_

        return row_cumsum_(x.float().contiguous().clone())

    @staticmethod
    def cumsum_(x: Tensor) -> Tensor:
        from radixgen.kernels.batch_invariant import row_cumsum_

        if x.is_contiguous():
            return row_cumsum_(x)
        return x.copy_(row_cumsum_(x.contiguous()))

    @staticmethod
    def argmax(x: Tensor) -> Tensor:
        from radixgen.kernels.batch_invariant import row_argmax

        return row_argmax(x.contiguous())


TORCH_ROWS = TorchRows()
