"""Grammar bitmask: set the logits of disallowed tokens to -inf, in place.

Layout (xgrammar's): bitmask (rows, W) int32; token t is allowed iff bit (t % 32) of word (t // 32) is set,
bit 0 being the least significant. Tokens t >= 32 * W (a model vocab padded past the tokenizer's) are
disallowed; bits past the logits' width V are ignored. Row i of the bitmask applies to logits row
indices[i], or row i when indices is None (unlike xgrammar's apply_token_bitmask_inplace, whose indices
pick the same row of both tensors, the bitmask here holds only the constrained rows).
Strategy: one program per (bitmask row, chunk of BLOCK tokens); it stores -inf only where a bit is clear.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, expect, require_triton


def _check_bitmask(logits, bitmask, indices) -> None:
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    check_tensor("bitmask", bitmask, 2, (torch.int32,))
    expect(bitmask.shape[1] >= 1, f"bitmask must have at least one word per row, got {tuple(bitmask.shape)}")
    if indices is None:
        expect(bitmask.shape[0] == logits.shape[0],
               f"bitmask has {bitmask.shape[0]} rows but logits has {logits.shape[0]} (pass indices to map)")
    else:
        check_tensor("indices", indices, 1, INDEX_DTYPES)
        expect(indices.shape[0] == bitmask.shape[0],
               f"indices has {indices.shape[0]} entries but bitmask has {bitmask.shape[0]} rows")
    check_same_device(logits=logits, bitmask=bitmask, indices=indices)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         indices: torch.Tensor | None = None) -> None:
    """In place on logits (B, V). Indices are not range-checked (device sync): they must lie in [0, B)."""
    _check_bitmask(logits, bitmask, indices)
    require_triton("apply_token_bitmask_", "apply_token_bitmask_ref_")
    from ._bitmask_triton import launch_bitmask

    launch_bitmask(logits, bitmask, indices)


def apply_token_bitmask_ref_(logits: torch.Tensor, bitmask: torch.Tensor,
                             indices: torch.Tensor | None = None) -> None:
    _check_bitmask(logits, bitmask, indices)
    vocab, width = logits.shape[1], bitmask.shape[1]
    tokens = torch.arange(vocab, device=logits.device)
    word = tokens // 32
    words = bitmask[:, word.clamp(max=width - 1)]  # (rows, V)
    allowed = ((words >> (tokens % 32).to(torch.int32)) & 1).bool() & (word < width)
    rows = indices.long() if indices is not None else torch.arange(logits.shape[0], device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
