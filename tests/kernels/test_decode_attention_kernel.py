import pytest
import torch
from kernel_testutil import DEVICE, TOL, lens_tensor, make_pool, rel_err

from radixgen.kernels import decode_attention, decode_attention_ref

NUM_KV_HEADS = 2
LENS = [37, 1, 16, 70]  # a single token, exactly one interpreter block, several blocks with a ragged tail


def naive_decode(q, pool, seq_lens, sm_scale):
    """Per request and head: a dense softmax over the request's slots, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // pool.k_buffer.shape[1]
    for b, (row, n) in enumerate(zip(pool.req_indices.tolist(), seq_lens.tolist(), strict=True)):
        slots = pool.req_to_slot[row, :n].long()
        for h in range(q.shape[1]):
            k = pool.k_buffer[slots, h // group].double().cpu()  # (n, D)
            v = pool.v_buffer[slots, h // group].double().cpu()
            probs = torch.softmax(k @ q[b, h].double().cpu() * sm_scale, dim=0)
            out[b, h] = probs @ v
    return out


def _inputs(gen, dtype, head_dim, group, lens=LENS, index_dtype=torch.int64):
    pool = make_pool(lens, NUM_KV_HEADS, head_dim, dtype, index_dtype=index_dtype, gen=gen)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, pool, lens_tensor(lens, index_dtype)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_ref(triton, poison, gen, dtype, head_dim, group):
    q, pool, seq_lens = _inputs(gen, dtype, head_dim, group)
    sm_scale = head_dim**-0.5
    out = decode_attention(q, *pool[:3], pool.req_indices, seq_lens, sm_scale)
    ref = decode_attention_ref(q, *pool[:3], pool.req_indices, seq_lens, sm_scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_kv_splits", [1, 2, 5])
def test_decode_kernel_explicit_splits_strided_q_int32_table(triton, poison, gen, num_kv_splits):
    # 5 splits leave most splits of the short requests empty; the merge must skip them
    dtype, head_dim, group = torch.float32, 16, 3
    _, pool, seq_lens = _inputs(gen, dtype, head_dim, group, index_dtype=torch.int32)
    wide = torch.randn(len(LENS), NUM_KV_HEADS * group, 2 * head_dim, generator=gen).to(DEVICE)
    q = wide[..., :head_dim]  # non-contiguous: stride(1) == 2 * head_dim
    out = decode_attention(q, *pool[:3], pool.req_indices, seq_lens, 0.3, num_kv_splits=num_kv_splits)
    ref = decode_attention_ref(q, *pool[:3], pool.req_indices, seq_lens, 0.3)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="long contexts are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_long_contexts_cuda(triton, poison, gen, dtype):
    lens = [1000, 4097, 1, 2048]
    pool = make_pool(lens, 8, 128, dtype, max_context_len=4200, gen=gen)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(dtype).to(DEVICE)
    seq_lens = lens_tensor(lens)
    out = decode_attention(q, *pool[:3], pool.req_indices, seq_lens, 128**-0.5)
    ref = decode_attention_ref(q, *pool[:3], pool.req_indices, seq_lens, 128**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_kv_splits", [None, 1, 4])
def test_decode_ref_matches_naive_softmax(gen, num_kv_splits):
    q, pool, seq_lens = _inputs(gen, torch.float32, 16, 3)
    ref = decode_attention_ref(q, *pool[:3], pool.req_indices, seq_lens, 0.25, num_kv_splits=num_kv_splits)
    assert rel_err(ref.cpu(), naive_decode(q, pool, seq_lens, 0.25)) < 1e-5


def _bad_cases(q, pool, seq_lens):
    kb, vb, table, rows = pool
    return [
        (dict(q=q.to(torch.bfloat16)), "q dtype"),
        (dict(q=q[0]), "q must be 3-D"),
        (dict(q=q[:, :5]), "not a multiple"),
        (dict(q=q[..., :8]), "head_dim"),
        (dict(k_buffer=kb.transpose(0, 1).contiguous().transpose(0, 1)), "k_buffer must be contiguous"),
        (dict(v_buffer=vb[:-1]), "v_buffer"),
        (dict(req_to_slot=table[0]), "req_to_slot must be 2-D"),
        (dict(req_indices=rows.float()), "req_indices dtype"),
        (dict(seq_lens=seq_lens[:-1]), r"seq_lens.shape\[0\]"),
        (dict(seq_lens=seq_lens.float()), "seq_lens dtype"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(num_kv_splits=0), "num_kv_splits"),
    ]


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_ref])
def test_decode_rejects_bad_arguments(gen, fn):
    q, pool, seq_lens = _inputs(gen, torch.float32, 16, 3)
    good = dict(q=q, k_buffer=pool.k_buffer, v_buffer=pool.v_buffer, req_to_slot=pool.req_to_slot,
                req_indices=pool.req_indices, seq_lens=seq_lens, sm_scale=0.25)
    for change, message in _bad_cases(q, pool, seq_lens):
        with pytest.raises(ValueError, match=message):
            fn(**{**good, **change})


def test_decode_ref_rejects_empty_request(gen):
    q, pool, seq_lens = _inputs(gen, torch.float32, 16, 1)
    with pytest.raises(ValueError, match="seq_lens entry must be >= 1"):
        decode_attention_ref(q, *pool[:3], pool.req_indices, seq_lens * 0, 0.25)
