import pytest
import torch
from kernel_testutil import DEVICE, TOL, lens_tensor, make_pool, rel_err

from radixgen.kernels import extend_attention, extend_attention_ref

NUM_KV_HEADS = 2
PREFIX = [0, 21, 5, 40]
EXTEND = [7, 33, 1, 0]  # no prefix; a ragged multi-block extend; one token; a request with nothing new


def naive_extend(q, pool, prefix_lens, extend_lens, sm_scale):
    """Token by token: new token i of request b attends to positions [0, prefix + i], in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // pool.k_buffer.shape[1]
    t = 0
    for row, prefix, extend in zip(pool.req_indices.tolist(), prefix_lens, extend_lens, strict=True):
        for i in range(extend):
            slots = pool.req_to_slot[row, :prefix + i + 1].long()
            for h in range(q.shape[1]):
                k = pool.k_buffer[slots, h // group].double().cpu()
                v = pool.v_buffer[slots, h // group].double().cpu()
                out[t, h] = torch.softmax(k @ q[t, h].double().cpu() * sm_scale, dim=0) @ v
            t += 1
    return out


def _inputs(gen, dtype, head_dim, group, prefix=PREFIX, extend=EXTEND):
    pool = make_pool([p + e for p, e in zip(prefix, extend, strict=True)], NUM_KV_HEADS, head_dim, dtype,
                     gen=gen)
    q = torch.randn(sum(extend), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, pool, lens_tensor(prefix), lens_tensor(extend)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_matches_ref(triton, poison, gen, dtype, head_dim, group):
    q, pool, prefix_lens, extend_lens = _inputs(gen, dtype, head_dim, group)
    sm_scale = head_dim**-0.5
    out = extend_attention(q, *pool, prefix_lens, extend_lens, sm_scale)
    ref = extend_attention_ref(q, *pool, prefix_lens, extend_lens, sm_scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_extend_kernel_plain_prefill_int32_strided_q(triton, poison, gen):
    # no prefixes at all, one request ending exactly on a block boundary, q a strided view
    prefix, extend = [0, 0, 0], [16, 5, 19]
    _, pool, prefix_lens, extend_lens = _inputs(gen, torch.float32, 16, 3, prefix, extend)
    pool = pool._replace(req_to_slot=pool.req_to_slot.int(), req_indices=pool.req_indices.int())
    q = torch.randn(sum(extend), 2 * NUM_KV_HEADS * 3, 16, generator=gen).to(DEVICE)[:, ::2]
    out = extend_attention(q, *pool, prefix_lens.int(), extend_lens.int(), 0.25)
    ref = extend_attention_ref(q, *pool, prefix_lens, extend_lens, 0.25)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="long contexts are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_long_contexts_cuda(triton, poison, gen, dtype):
    prefix, extend = [1000, 0, 77], [300, 513, 64]
    pool = make_pool([p + e for p, e in zip(prefix, extend, strict=True)], 8, 128, dtype,
                     max_context_len=1400, gen=gen)
    q = torch.randn(sum(extend), 32, 128, generator=gen).to(dtype).to(DEVICE)
    args = (q, *pool, lens_tensor(prefix), lens_tensor(extend), 128**-0.5)
    assert rel_err(extend_attention(*args), extend_attention_ref(*args)) < TOL[dtype]


def test_extend_ref_matches_naive_softmax(gen):
    q, pool, prefix_lens, extend_lens = _inputs(gen, torch.float32, 16, 3)
    ref = extend_attention_ref(q, *pool, prefix_lens, extend_lens, 0.25)
    assert rel_err(ref.cpu(), naive_extend(q, pool, PREFIX, EXTEND, 0.25)) < 1e-5


@pytest.mark.parametrize("fn", [extend_attention, extend_attention_ref])
def test_extend_rejects_bad_arguments(gen, fn):
    q, pool, prefix_lens, extend_lens = _inputs(gen, torch.float32, 16, 3)
    good = dict(q=q, k_buffer=pool.k_buffer, v_buffer=pool.v_buffer, req_to_slot=pool.req_to_slot,
                req_indices=pool.req_indices, prefix_lens=prefix_lens, extend_lens=extend_lens, sm_scale=0.25)
    cases = [
        (dict(q=q.reshape(q.shape[0], -1)), "q must be 3-D"),
        (dict(q=q.double()), "q dtype"),
        (dict(k_buffer=pool.k_buffer[:, :1]), "k_buffer"),
        (dict(prefix_lens=prefix_lens[:2]), r"prefix_lens.shape\[0\]"),
        (dict(extend_lens=extend_lens.float()), "extend_lens dtype"),
        (dict(sm_scale="0.25"), "sm_scale"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})


def test_extend_ref_checks_token_count(gen):
    q, pool, prefix_lens, extend_lens = _inputs(gen, torch.float32, 16, 1)
    with pytest.raises(ValueError, match="sum\\(extend_lens\\)"):
        extend_attention_ref(q[:-1], *pool, prefix_lens, extend_lens, 0.25)
