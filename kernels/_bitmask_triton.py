"""Triton body of apply_token_bitmask_ (see bitmask.py for the contract and strategy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_launchable


@triton.jit
def _bitmask_kernel(
    Logits, Bitmask, Indices,
    vocab, width,
    stride_l, stride_lv, stride_b, stride_bw,
    HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(Indices + i).to(tl.int64) if HAS_INDICES else i.to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    word = tokens // 32
    # 32 neighbouring lanes load the same word: served by one cache line, cheaper than a shuffle
    words = tl.load(Bitmask + i * stride_b + word * stride_bw, mask=in_vocab & (word < width), other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), Logits.dtype.element_ty)
    tl.store(Logits + row * stride_l + tokens * stride_lv, neg_inf, mask=in_vocab & ~allowed)


def launch_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    check_launchable(logits.device, "apply_token_bitmask_", "apply_token_bitmask_ref_")
    rows, vocab = bitmask.shape[0], logits.shape[1]
    if rows == 0 or vocab == 0:
        return
    block = 1024
    _bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits, bitmask, indices if indices is not None else bitmask,
        vocab, bitmask.shape[1],
        *logits.stride(), *bitmask.stride(),
        HAS_INDICES=indices is not None, BLOCK=block,
    )
