import pytest
import torch
from kernel_testutil import DEVICE

from radixgen.kernels import apply_token_bitmask_, apply_token_bitmask_ref_


def naive_bitmask_(logits, bitmask, indices):
    """Python ints, bit by bit."""
    rows = list(range(logits.shape[0])) if indices is None else indices.tolist()
    words = bitmask.tolist()
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            w = token // 32
            if w >= len(words[i]) or not (words[i][w] & 0xFFFFFFFF) >> (token % 32) & 1:
                logits[row, token] = float("-inf")


def _inputs(gen, dtype, vocab, width, rows=4, mask_rows=None):
    logits = torch.randn(rows, vocab, generator=gen).to(dtype).to(DEVICE)
    # full int32 range, so bit 31 (the sign bit) is exercised
    bitmask = torch.randint(-2**31, 2**31, (mask_rows or rows, width), generator=gen, dtype=torch.int64)
    return logits, bitmask.to(torch.int32).to(DEVICE)


CASES = [  # (vocab, bitmask width): exact words; V not a multiple of 32; a bitmask narrower than the vocab
    (64, 2), (70, 3), (100, 2),
]


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize(("vocab", "width"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_matches_ref(triton, gen, dtype, vocab, width, with_indices):
    indices = torch.tensor([3, 0], device=DEVICE) if with_indices else None
    logits, bitmask = _inputs(gen, dtype, vocab, width, mask_rows=2 if with_indices else None)
    expected = logits.clone()
    apply_token_bitmask_ref_(expected, bitmask, indices)
    apply_token_bitmask_(logits, bitmask, indices)
    assert torch.equal(logits, expected)
    masked = expected.isinf().sum().item()
    assert 0 < masked < expected.numel()


@pytest.mark.parametrize(("vocab", "width"), CASES)
def test_bitmask_ref_matches_naive_bits(gen, vocab, width):
    logits, bitmask = _inputs(gen, torch.float32, vocab, width, mask_rows=3)
    indices = torch.tensor([2, 0, 3], device=DEVICE)
    expected = logits.clone().cpu()
    naive_bitmask_(expected, bitmask.cpu(), indices.cpu())
    apply_token_bitmask_ref_(logits, bitmask, indices)
    assert torch.equal(logits.cpu(), expected)
    assert torch.isfinite(logits[1]).all()  # a row no bitmask row maps to is left alone


@pytest.mark.parametrize("fn", [apply_token_bitmask_, apply_token_bitmask_ref_])
def test_bitmask_rejects_bad_arguments(gen, fn):
    logits, bitmask = _inputs(gen, torch.float32, 70, 3)
    good = dict(logits=logits, bitmask=bitmask, indices=None)
    cases = [
        (dict(bitmask=bitmask.long()), "bitmask dtype"),
        (dict(bitmask=bitmask[:2]), "pass indices"),
        (dict(bitmask=bitmask[:2], indices=torch.tensor([0, 1, 2], device=DEVICE)), "indices has 3 entries"),
        (dict(indices=torch.arange(4.0, device=DEVICE)), "indices dtype"),
        (dict(logits=logits.int()), "logits dtype"),
        (dict(bitmask=bitmask[:, :0]), "at least one word"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})
