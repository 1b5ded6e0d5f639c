"""The kernel-level facts the deterministic mode rests on (runtime/deterministic.py): a bf16 matmul row's bits do
not depend on how many rows the call has (the gemv up to 16 rows, the blocked GEMM beyond), and decode attention
over fixed pieces gives a request the same bits alone, in any batch and under any thread count, while the default
split (which follows the batch) does not; a row-parallel matmul split at tp 2's cut (k_split) gives the bits of
two ranks' unrounded partial sums added in rank order (layers/fixed_order.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL, make_pool, rel_err

from radixgen.kernels import cpu, cpu_linear, decode_attention_ref

KL = cpu.lib() if cpu.available() else None
pytestmark = pytest.mark.skipif(KL is None or not KL.has_decode_step,
                                reason="the deterministic mode needs the AVX512-BF16 build of the CPU kernels")


@pytest.mark.parametrize(("n", "k", "bias"), [(576, 576, False), (200, 96, True), (45, 1536, False)])
def test_bf16_matmul_rows_do_not_depend_on_the_row_count(n, k, bias, gen):
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    pw = cpu_linear.pack_bf16(w)
    x = torch.randn(200, k, generator=gen).to(torch.bfloat16)
    whole = cpu_linear.linear(pw, x, b)  # the blocked GEMM (more than 16 rows)
    logits = cpu_linear.linear(pw, x, b, float_out=True)
    assert rel_err(whole, cpu_linear.linear_ref(pw, x, b)) < TOL[torch.bfloat16]
    start = 0
    for rows in (1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 64, 32):  # the gemv's tiles (8 / 4 / 2 / 1) and the GEMM's
        part = cpu_linear.linear(pw, x[start:start + rows], b)
        assert torch.equal(part, whole[start:start + rows]), f"{rows} rows from row {start}"
        assert torch.equal(cpu_linear.linear(pw, x[start:start + rows], b, float_out=True),
                           logits[start:start + rows])
        start += rows
    assert start == 200


def _attention(pool, q, lens, piece, threads=None):
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return cpu.decode_attention(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices,
                                    torch.tensor(lens), 0.125, piece=piece)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("head_dim", [64, 16, 40])
def test_fixed_pieces_give_a_request_the_same_bits_in_any_batch(head_dim, gen):
    lens = [700, 3, 129, 128, 1, 900, 257] + [int(v) for v in torch.randint(1, 1000, (57,), generator=gen)]
    pool = make_pool(lens, 2, head_dim, torch.bfloat16, max_reqs=70, max_context_len=1000, gen=gen)
    q = torch.randn(len(lens), 6, head_dim, generator=gen).to(torch.bfloat16)
    piece = cpu.FIXED_PIECE
    full = _attention(pool, q, lens, piece)
    ref = decode_attention_ref(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices,
                               torch.tensor(lens), 0.125)
    assert rel_err(full, ref) < TOL[torch.bfloat16]
    for b in range(7):  # alone, and among the first 2, 8 and 64 requests, with one and two threads
        alone = pool._replace(req_indices=pool.req_indices[b:b + 1])
        assert torch.equal(_attention(alone, q[b:b + 1], lens[b:b + 1], piece, threads=1), full[b:b + 1])
        for m in (2, 8, 64):
            if b < m:
                some = pool._replace(req_indices=pool.req_indices[:m])
                assert torch.equal(_attention(some, q[:m], lens[:m], piece, threads=2)[b], full[b])
    if head_dim != 64:
        return
    # the default split follows the batch: a long request alone rounds apart from itself among 64 (at head size
    # 16 the bf16 outputs happen to hide it for these requests)
    default = _attention(pool, q, lens, 0)
    alone = [torch.equal(_attention(pool._replace(req_indices=pool.req_indices[b:b + 1]), q[b:b + 1],
                                    lens[b:b + 1], 0, threads=2), default[b:b + 1]) for b in (0, 5)]
    assert not all(alone)


def test_pieces_must_cover_the_contexts(gen):
    pool = make_pool([300], 2, 64, torch.bfloat16, max_context_len=320, gen=gen)
    q = torch.randn(1, 6, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="piece"):
        _attention(pool, q, [300], 24)
    part = torch.empty(1 * 2 * 2 * 3 * 66)  # two pieces of 128 for a context of 300: the C kernel refuses
    with pytest.raises(cpu.CKernelError, match="not supported"):
        KL.fn("decode_attention", "bf16")(
            q=q.data_ptr(), q_stride=q.stride(0), k_buf=pool.k_buffer.data_ptr(), v_buf=pool.v_buffer.data_ptr(),
            table=pool.req_to_slot.data_ptr(), table_stride=pool.req_to_slot.stride(0),
            rows=pool.req_indices.data_ptr(), seq_lens=torch.tensor([300]).data_ptr(),
            out=torch.empty_like(q).data_ptr(),
            B=1, H=6, Hkv=2, D=64, scale=0.125, splits=2, piece=128, part=part.data_ptr())


@pytest.mark.parametrize(("n", "k", "cut", "bias"),
                         [(576, 1536, 768, False), (576, 576, 384, True), (45, 96, 32, False)])
def test_a_split_matmul_is_two_ranks_partial_sums_added(n, k, cut, bias, gen):
    """The deterministic mode's row-parallel matmul (layers/fixed_order.py): tp 1's weight with k_split gives the
    bits of two ranks holding columns [0, cut) and [cut, k), each writing its unrounded partial sums, added in rank
    order by sum_partials, at every row count (the gemv tiles and the GEMM's); rounding each rank's sum first, as
    the default all-reduce does, rounds apart."""
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    whole = cpu_linear.pack_bf16(w)
    whole.fix_order(k_split=cut)
    ranks = [cpu_linear.pack_bf16(w[:, :cut]), cpu_linear.pack_bf16(w[:, cut:])]
    for r in ranks:
        r.fix_order(partial=True)
    x = torch.randn(200, k, generator=gen).to(torch.bfloat16)
    y = cpu_linear.linear(whole, x, b)
    assert rel_err(y, cpu_linear.linear_ref(cpu_linear.pack_bf16(w), x, b)) < TOL[torch.bfloat16]
    parts = [cpu_linear.linear(r, x[:, cols].contiguous(), float_out=True)
             for r, cols in zip(ranks, (slice(0, cut), slice(cut, k)), strict=True)]
    exact = x[:, :cut].float() @ w[:, :cut].float().t()
    assert (parts[0] - exact).abs().max() < 1e-3 * exact.abs().max()  # float32, not rounded to bf16
    assert torch.equal(cpu_linear.sum_partials(KL, torch.stack(parts), b), y)
    start = 0
    for rows in (1, 2, 3, 8, 15, 16, 17, 64, 74):
        assert torch.equal(cpu_linear.linear(whole, x[start:start + rows], b), y[start:start + rows]), rows
        start += rows
    rounded = sum(p.to(torch.bfloat16) for p in parts)
    assert not torch.equal(rounded if b is None else rounded + b, y)


def test_a_fixed_order_is_for_bf16_weights_on_even_cuts(gen):
    q = torch.randint(-8, 8, (32, 64), generator=gen, dtype=torch.int8)
    with pytest.raises(ValueError, match="bf16 K pairs"):
        cpu_linear.pack_int8(q, torch.ones(32, 2), 32).fix_order(k_split=32)
    pw = cpu_linear.pack_bf16(torch.randn(32, 64, generator=gen))
    for cut in (3, 64, -2):
        with pytest.raises(ValueError, match="k_split"):
            pw.fix_order(k_split=cut)
    pw.fix_order(partial=True)
    with pytest.raises(cpu.CKernelError, match="not supported"):  # a rank's partial sums carry no bias
        cpu_linear.linear(pw, torch.randn(2, 64, generator=gen).to(torch.bfloat16),
                          torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize(("tp", "k"), [(3, 576), (4, 1536)])
def test_a_larger_groups_sums_follow_no_batch(tp, k, gen):
    """tp 3 and 4 in the mode (layers/fixed_order.py): each rank's share of the input columns its own partial sums,
    gathered and added in rank order. A row gets the same bits at every row count of the ranks' calls, and every
    rank's sum of the gathered parts is the same (they add the same tensor)."""
    n = 200
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    cuts = [k * r // tp // 2 * 2 for r in range(tp)] + [k]  # even cuts, as the layers' shares
    ranks = [cpu_linear.pack_bf16(w[:, a:b].contiguous()) for a, b in zip(cuts, cuts[1:], strict=False)]
    for r in ranks:
        r.fix_order(partial=True)
    x = torch.randn(90, k, generator=gen).to(torch.bfloat16)

    def step(rows: torch.Tensor) -> torch.Tensor:
        parts = [cpu_linear.linear(r, rows[:, a:b].contiguous(), float_out=True)
                 for r, a, b in zip(ranks, cuts, cuts[1:], strict=False)]
        return cpu_linear.sum_partials(KL, torch.stack(parts))

    y = step(x)
    assert rel_err(y, cpu_linear.linear_ref(cpu_linear.pack_bf16(w), x, None)) < TOL[torch.bfloat16]
    start = 0
    for rows in (1, 2, 3, 16, 17, 51):
        assert torch.equal(step(x[start:start + rows]), y[start:start + rows]), rows
        start += rows
