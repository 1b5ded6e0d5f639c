"""A grammar's token bitmask applied to float32 CPU logits in C (csrc/cpu_bitmask.h).

xgrammar's own CPU `apply_token_bitmask_inplace` visits every token of a row, which at batch 32 over a 49k
vocabulary costs ~6 ms a step when the masks are closed (the middle of a JSON key: a handful of tokens allowed),
about a tenth of the default model's whole decode step. The C loop goes a 32-token word at a time: an open word
is skipped, a closed one is a run of stores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import cpu
from ._checks import check_contiguous, expect


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab: int,
                        *, kl=None) -> None:
    """In place: in rows `rows` of logits (B, >= vocab) float32, the ids a bitmask (B', ceil(vocab / 32)) int32
    row (same row index) does not allow, and the ids >= vocab, become -inf."""
    expect(logits.dtype == torch.float32 and logits.dim() == 2, f"logits must be (B, V) float32, got "
                                                                f"{tuple(logits.shape)} {logits.dtype}")
    expect(bitmask.dtype == torch.int32 and bitmask.dim() == 2, "bitmask must be (B, words) int32")
    expect(logits.device.type == "cpu" and bitmask.device.type == "cpu", "logits and bitmask must be CPU tensors")
    check_contiguous("bitmask", bitmask)
    expect(logits.stride(1) == 1, "logits rows must be contiguous")
    expect(logits.shape[1] >= vocab and bitmask.shape[1] * 32 >= vocab,
           f"vocab {vocab} exceeds the logits' {logits.shape[1]} columns or the bitmask's {bitmask.shape[1]} words")
    idx = torch.tensor(list(rows), dtype=torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= min(logits.shape[0], bitmask.shape[0])):
        raise ValueError(f"rows must be in [0, {min(logits.shape[0], bitmask.shape[0])})")
    kl = kl or cpu.lib()
    expect(kl is not None, "the CPU kernels are not available")
    kl.fn("rg_apply_token_bitmask_f32")(
        logits=logits.data_ptr(), ld=logits.stride(0), bitmask=bitmask.data_ptr(), words=bitmask.shape[1],
        rows=idx.data_ptr(), n_rows=idx.numel(), vocab=vocab)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab: int) -> None:
    """The torch reference of apply_token_bitmask."""
    bits = torch.arange(32, dtype=torch.int32)
    for r in rows:
        allowed = ((bitmask[r].unsqueeze(-1) >> bits) & 1).bool().flatten()[:vocab]
        logits[r, :vocab].masked_fill_(~allowed, float("-inf"))
        logits[r, vocab:] = float("-inf")
