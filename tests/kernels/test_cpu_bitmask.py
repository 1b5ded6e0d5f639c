"""The C token-bitmask kernel (kernels/cpu_bitmask.py) against its torch reference and xgrammar's own apply:
open, closed and mixed words, a vocabulary that ends inside a word, padded logits, a subset of the rows."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from radixgen.kernels import cpu
from radixgen.kernels.cpu_bitmask import apply_token_bitmask, apply_token_bitmask_ref

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built here")


def _bitmask(g: torch.Generator, rows: int, words: int) -> torch.Tensor:
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    kinds = torch.randint(0, 3, (rows, words), generator=g)
    m[kinds == 0] = 0  # closed words
    m[kinds == 1] = -1  # open words
    return m


@pytest.mark.parametrize("vocab,padded", [(1000, 1000), (1000, 1024), (49152, 49152), (77, 96)])
def test_c_bitmask_equals_reference_and_xgrammar(vocab, padded):
    g = torch.Generator().manual_seed(vocab + padded)
    words = (vocab + 31) // 32
    mask = _bitmask(g, 6, words)
    rows = [0, 2, 3, 5]
    logits = torch.randn(6, padded, generator=g)
    want, theirs, got = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask, rows, vocab)
    apply_token_bitmask(got, mask, rows, vocab)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows not listed are untouched
    xgr.apply_token_bitmask_inplace(theirs[:, :vocab], mask, vocab_size=vocab, indices=rows)
    assert torch.equal(got[:, :vocab], theirs[:, :vocab])


def test_bad_arguments_are_refused():
    logits, mask = torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, mask, [2], 64)
    with pytest.raises(ValueError, match="float32"):
        apply_token_bitmask(logits.bfloat16(), mask, [0], 64)
    with pytest.raises(ValueError, match="exceeds"):
        apply_token_bitmask(logits, mask, [0], 65)
