import pytest
import torch
from kernel_testutil import DEVICE, TOL, rel_err

from radixgen.kernels import rotary_embedding_, rotary_embedding_ref_

T, HQ, HK, MAX_POS = 7, 6, 2, 64


def cos_sin_cache(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (max_pos, D/2)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inputs(gen, dtype, head_dim):
    positions = torch.randint(1, MAX_POS, (T,), generator=gen).to(DEVICE)  # position 0 would not rotate
    q = torch.randn(T, HQ, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(T, HK, head_dim, generator=gen).to(dtype).to(DEVICE)
    return positions, q, k, cos_sin_cache(head_dim).to(DEVICE)


@pytest.mark.parametrize("layout", ["heads", "flat", "qkv_views"])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_matches_ref(triton, gen, dtype, head_dim, layout):
    positions, q, k, cache = _inputs(gen, dtype, head_dim)
    if layout == "flat":
        q, k = q.reshape(T, -1), k.reshape(T, -1)
    elif layout == "qkv_views":  # the slices of one fused projection, (T, H*D) and non-contiguous
        qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), torch.zeros_like(k.reshape(T, -1))), dim=1)
        q, k = qkv[:, :HQ * head_dim], qkv[:, HQ * head_dim:(HQ + HK) * head_dim]
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_(positions, q, k, cache, head_dim)
    rotary_embedding_ref_(positions, q_ref, k_ref, cache, head_dim)
    assert rel_err(q, q_ref) < TOL[dtype] and rel_err(k, k_ref) < TOL[dtype]
    if layout == "qkv_views":
        assert (qkv[:, (HQ + HK) * head_dim:] == 0).all()  # the v part of the fused tensor stays untouched


def test_rotary_ref_matches_hf_rotate_half(gen):
    """The transformers formula: q * cos(emb) + rotate_half(q) * sin(emb), emb = cat(freqs, freqs)."""
    positions, q, k, cache = _inputs(gen, torch.float32, 16)
    half = 8
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    emb = torch.cat([positions.cpu().double()[:, None] * inv_freq] * 2, dim=-1)[:, None, :]  # (T, 1, D)

    def hf(x):
        x = x.double().cpu()
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * emb.cos() + rotated * emb.sin()

    expected_q, expected_k = hf(q), hf(k)
    rotary_embedding_ref_(positions, q, k, cache, 16)
    assert rel_err(q.cpu(), expected_q) < 1e-5 and rel_err(k.cpu(), expected_k) < 1e-5


@pytest.mark.parametrize("fn", [rotary_embedding_, rotary_embedding_ref_])
def test_rotary_rejects_bad_arguments(gen, fn):
    positions, q, k, cache = _inputs(gen, torch.float32, 16)
    good = dict(positions=positions, q=q, k=k, cos_sin_cache=cache, head_dim=16)
    cases = [
        (dict(head_dim=15), "head_dim must be a positive even int"),
        (dict(q=q[..., :8]), "last dim must be head_dim=16"),
        (dict(k=k.reshape(T, -1)[:, :20]), "multiple of 16"),
        (dict(cos_sin_cache=cache[:, :8]), "partial rotary"),
        (dict(cos_sin_cache=cache.double()), "cos_sin_cache dtype"),
        (dict(positions=positions[:-1]), "one row per position"),
        (dict(positions=positions.float()), "positions dtype"),
        (dict(q=q[0, 0]), "q must be 2 or 3-D"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})
