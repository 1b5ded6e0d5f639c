"""The batch-invariant Triton kernels (radixgen.kernels.batch_invariant, the deterministic mode on CUDA): a row's
bits alone, in batches of 2 / 5 / 8 at different positions, and under other chunkings of its context are the same.
On the CPU they run under the Triton interpreter (tiny shapes); benchmarks/gpu_check.sh runs them on a GPU."""

import pytest
import torch
from kernel_testutil import CODE_DTYPES, DEVICE, TOL, lens_tensor, make_pool, quantize_pool, rel_err

from radixgen.kernels import batch_invariant as bi
from radixgen.kernels import decode_attention_ref, extend_attention_ref, int8_matmul, int8_matmul_ref

# pieces of 32 positions under the interpreter (its key blocks are 16), of 64 compiled (its blocks are 64)
PIECE = 32 if DEVICE.type == "cpu" else 64
# two or three pieces per context, exactly one, a one-token context, ragged tails
LENS = [2 * PIECE + 11, 1, PIECE, 2 * PIECE + 1, PIECE + 8, PIECE // 2 + 1, PIECE + 18, 7]
# the batches a row is checked in: (its position, the others' indices)
BATCHES = [(0, [0, 5]), (1, [6, 0]), (3, [2, 4, 1, 0, 7]), (4, [7, 6, 5, 3, 0]), (5, [1, 2, 3, 4, 5, 0, 6, 7])]


def _batches(row: int):
    """Index lists of 2, 5 and 8 rows holding `row` at different positions, and its position in each."""
    for pos, others in BATCHES:
        rest = [i for i in others if i != row]
        idx = rest[:pos] + [row] + rest[pos:len(others) - 1]
        yield idx, idx.index(row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_matmul_row_bits_do_not_follow_the_batch(triton, poison, gen, dtype):
    x = torch.randn(8, 96, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(80, 96, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(80, generator=gen).to(dtype).to(DEVICE)
    full = bi.fixed_matmul(x, w, bias)
    assert rel_err(full, bi.fixed_matmul_ref(x, w, bias)) < TOL[dtype]
    for row in (0, 5):
        assert torch.equal(bi.fixed_matmul(x[row:row + 1], w, bias)[0], full[row])
        for idx, at in _batches(row):
            assert torch.equal(bi.fixed_matmul(x[idx], w, bias)[at], full[row]), (row, idx)
    wide = torch.randn(8, 130, generator=gen).to(dtype).to(DEVICE)  # strided rows: the same bits
    wide[:, :96] = x
    assert torch.equal(bi.fixed_matmul(wide[:, :96], w, bias), full)


def test_int8_matmul_batch_invariant_tiles(triton, poison, gen):
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8).to(DEVICE)
    s = (torch.rand(48, generator=gen) * 0.01 + 0.001).to(DEVICE)
    full = int8_matmul(x, q, s, batch_invariant=True)
    assert rel_err(full, int8_matmul_ref(x, q, s)) < TOL[torch.bfloat16]
    for row in (0, 17):
        assert torch.equal(int8_matmul(x[row:row + 1], q, s, batch_invariant=True)[0], full[row])
        assert torch.equal(int8_matmul(x[row:row + 2], q, s, batch_invariant=True)[0], full[row])


def _decode_case(gen, dtype, group=2):
    pool = make_pool(LENS, 1, 32, dtype, max_reqs=9, max_context_len=3 * PIECE, gen=gen)
    q = torch.randn(len(LENS), group, 32, generator=gen).to(dtype).to(DEVICE)
    return q, pool, lens_tensor(LENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_fixed_row_bits_do_not_follow_the_batch(triton, poison, gen, dtype):
    q, pool, seq_lens = _decode_case(gen, dtype)
    args = (*pool[:3],)
    full = bi.decode_attention_fixed(q, *args, pool.req_indices, seq_lens, 0.2, PIECE)
    ref = decode_attention_ref(q, *args, pool.req_indices, seq_lens, 0.2)
    assert rel_err(full, ref) < TOL[dtype]
    for row in ((0,) if dtype == torch.float32 else (3,)):
        alone = bi.decode_attention_fixed(q[row:row + 1], *args, pool.req_indices[row:row + 1],
                                          seq_lens[row:row + 1], 0.2, PIECE, num_kv_splits=3)
        assert torch.equal(alone[0], full[row])
        for idx, at in _batches(row):
            t = torch.tensor(idx, device=DEVICE)
            out = bi.decode_attention_fixed(q[t], *args, pool.req_indices[t], seq_lens[t], 0.2, PIECE,
                                            num_kv_splits=3 if len(idx) % 2 else None)
            assert torch.equal(out[at], full[row]), (row, idx)


def test_extend_fixed_equals_decode_whatever_the_chunking(triton, poison, gen):
    """A prompt over two pieces as one extend, as two chunks (each beside another request) and token by token as
    decode queries: every token's bits are the same."""
    dtype, n = torch.bfloat16, PIECE + 8
    pool = make_pool([n, 10], 1, 32, dtype, max_reqs=4, max_context_len=2 * PIECE, gen=gen)
    me, other = pool.req_indices[0:1], pool.req_indices[1:2]
    q = torch.randn(n, 2, 32, generator=gen).to(dtype).to(DEVICE)
    q_other = torch.randn(10, 2, 32, generator=gen).to(dtype).to(DEVICE)
    kv = (*pool[:3],)
    one = bi.extend_attention_fixed(q, *kv, me, lens_tensor([0]), lens_tensor([n]), 0.2, PIECE)
    ref = extend_attention_ref(q, *kv, me, lens_tensor([0]), lens_tensor([n]), 0.2)
    assert rel_err(one, ref) < TOL[dtype]
    cut = PIECE + 3  # past the first piece: the second chunk's tokens read a cached whole piece
    first = bi.extend_attention_fixed(torch.cat([q_other[:5], q[:cut]]), *kv, torch.cat([other, me]),
                                      lens_tensor([0, 0]), lens_tensor([5, cut]), 0.2, PIECE)
    second = bi.extend_attention_fixed(torch.cat([q[cut:], q_other[5:]]), *kv, torch.cat([me, other]),
                                       lens_tensor([cut, 5]), lens_tensor([n - cut, 5]), 0.2, PIECE)
    assert torch.equal(torch.cat([first[5:], second[:n - cut]]), one)
    for pos in (0, PIECE - 1, PIECE, n - 1):
        dec = bi.decode_attention_fixed(q[pos:pos + 1], *kv, me, lens_tensor([pos + 1]), 0.2, PIECE)
        assert torch.equal(dec[0], one[pos]), pos


def _rows(gen):
    x = torch.randn(8, 300, generator=gen).to(DEVICE) * 4
    x[2, 7] = x[2, 200] = x[2].max() + 1  # a tie for the largest: the first index wins
    x[4, :] = float("-inf")
    x[4, 299] = 0.0  # the largest value in the last block
    return x


@pytest.mark.parametrize("op", ["row_log_softmax", "row_sum", "row_cumsum_", "row_argmax"])
def test_row_ops_bits_do_not_follow_the_batch(triton, poison, gen, op):
    x = _rows(gen)
    if op in ("row_sum", "row_cumsum_"):
        x = x.exp()
    kernel, ref = getattr(bi, op), getattr(bi, "row_cumsum_ref_" if op == "row_cumsum_" else op + "_ref")
    full = kernel(x.clone())
    want = ref(x.clone())
    if op == "row_argmax":
        assert full.tolist() == want.tolist() and full[2] == 7 and full[4] == 299
    else:
        assert torch.allclose(full, want, rtol=1e-5, atol=1e-5)
    for row in (2, 4):
        assert torch.equal(kernel(x[row:row + 1].clone())[0], full[row])
        for idx, at in _batches(row):
            assert torch.equal(kernel(x[idx].clone())[at], full[row]), (row, idx)


def test_row_cumsum_prefix_does_not_follow_the_row_length(triton, gen):
    """The sampler scans candidate prefixes of different lengths: a prefix's running sums are the same bits."""
    x = torch.rand(3, 300, generator=gen).to(DEVICE)
    full = bi.row_cumsum_(x.clone())
    for n in (1, 100, 128, 257):
        assert torch.equal(bi.row_cumsum_(x[:, :n].contiguous())[:, :n], full[:, :n])


def test_sampler_rows_a_seeded_row_does_not_follow_the_batch(triton, gen):
    """The sampler over the row kernels (the deterministic mode on CUDA): a seeded top-k / top-p row, and a greedy
    row with a tie, give the same token and logprob alone and among rows that send the batch down other paths."""
    from radixgen.common.sampling_params import SamplingParams
    from radixgen.runtime.executor.sampler import Sampler, SamplingBatch, make_generator
    from radixgen.runtime.executor.sampler_rows import BatchInvariantRows

    vocab = 300
    logits = torch.randn(6, vocab, generator=gen).to(DEVICE) * 3
    logits[1, 40] = logits[1, 250] = logits[1].max() + 1
    params = [SamplingParams(temperature=0.8, top_k=60, top_p=0.9, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.5), SamplingParams(temperature=1.3, top_p=0.5, seed=3)]
    sampler = Sampler(candidates=16, rows=BatchInvariantRows())

    def run(idx):
        p = [params[i] for i in idx]
        gens = [make_generator(q.seed) if q.seed is not None else None for q in p]
        batch = SamplingBatch.build(p, [[] for _ in p], [[] for _ in p], gens, vocab, DEVICE)
        out = sampler(logits[idx].clone(), batch, return_logprob=True)
        return out.next_ids.tolist(), out.logprobs.tolist()

    for row in (0, 1):
        ids, lps = run([row])
        assert row != 1 or ids == [40]
        for idx in ([row, 2], [3, row, 4, 5, 2], [5, 4, 3, 2, row]):
            got_ids, got_lps = run(idx)
            at = idx.index(row)
            assert (got_ids[at], got_lps[at]) == (ids[0], lps[0]), (row, idx)


def test_triton_ops_wire_the_batch_invariant_kernels(triton):
    """TritonOps(deterministic=True), as the CUDA runner builds it: every linear layer on a fixed-tile matmul (dense:
    fixed_matmul; int8: one row tile), attention over the CPU mode's fixed pieces, the sampler's row kernels; what
    it cannot keep refused by name (expert blocks here; the config's CUDA refusals below)."""
    from tiny_models import tiny_model_dir

    from radixgen.kernels.cpu import FIXED_PIECE
    from radixgen.runtime.config import RuntimeConfig
    from radixgen.runtime.executor.model_runner import ModelRunner
    from radixgen.runtime.layers.linear import LinearBase
    from radixgen.runtime.layers.ops import TritonOps

    base = dict(model=str(tiny_model_dir("llama")), dtype="bfloat16", max_total_tokens=256, max_running_requests=2)
    runner = ModelRunner(RuntimeConfig(**base), ops=TritonOps(deterministic=True))
    assert runner.ops.linear_methods(runner.model) == ["dense (fixed tiles)"]
    assert runner.ops.attention.piece == FIXED_PIECE
    int8 = ModelRunner(RuntimeConfig(**base, quantization="int8"), ops=TritonOps(deterministic=True))
    assert int8.ops.linear_methods(int8.model) == ["int8 (triton)"]
    assert all(m.method.batch_invariant for m in int8.model.modules() if isinstance(m, LinearBase))
    assert ModelRunner(RuntimeConfig(**base), ops=TritonOps()).ops.attention.piece == 0  # the default: untouched
    heads = torch.randn(5, 4, 16).to(torch.bfloat16).to(DEVICE)[:, 1:]  # per-head norms (q_norm), a strided view
    w = torch.randn(16).to(torch.bfloat16).to(DEVICE)
    normed = runner.ops.rms_norm(heads, w, 1e-6)
    assert torch.equal(runner.ops.rms_norm(heads[3:4], w, 1e-6)[0], normed[3])
    with pytest.raises(ValueError, match="on CUDA does not run expert blocks"):
        ModelRunner(RuntimeConfig(**{**base, "model": str(tiny_model_dir("qwen3_moe"))}),
                    ops=TritonOps(deterministic=True))


@pytest.mark.parametrize(("kw", "named"), [
    (dict(), "device=cuda and CUDA graphs"),
    (dict(disable_cuda_graph=True, tp_size=2), "device=cuda at tp_size=2"),
    (dict(disable_cuda_graph=True, pp_size=2), "device=cuda at tp_size=1, pp_size=2"),
    (dict(disable_cuda_graph=True, enable_lora=True), "device=cuda and LoRA adapters"),
    (dict(disable_cuda_graph=True, speculative_algorithm="ngram"), "device=cuda and speculative_algorithm=ngram"),
])
def test_the_cuda_mode_refuses_what_it_does_not_cover_by_name(kw, named):
    from radixgen.runtime.config import RuntimeConfig

    with pytest.raises(ValueError, match=f"deterministic mode does not run with {named}"):
        RuntimeConfig(deterministic=True, device="cuda", **kw)
    RuntimeConfig(deterministic=True, device="cuda", disable_cuda_graph=True)  # what the mode covers
    RuntimeConfig(deterministic=True, device="cuda", disable_cuda_graph=True, kv_cache_dtype="int8")


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_decode_fixed_8bit_pool_row_bits_do_not_follow_the_batch(triton, poison, gen, code_dtype):
    """An int8 / fp8 pool (codes and per-slot scales, dequantized in registers): the same identities."""
    q, pool, seq_lens = _decode_case(gen, torch.bfloat16)
    qp = quantize_pool(pool, code_dtype)
    kv = (qp.k_codes, qp.v_codes, pool.req_to_slot)
    full = bi.decode_attention_fixed(q, *kv, pool.req_indices, seq_lens, 0.2, PIECE, **qp.scales())
    ref = decode_attention_ref(q, *kv, pool.req_indices, seq_lens, 0.2, **qp.scales())
    assert rel_err(full, ref) < TOL[torch.bfloat16]
    row = 3
    alone = bi.decode_attention_fixed(q[row:row + 1], *kv, pool.req_indices[row:row + 1], seq_lens[row:row + 1], 0.2,
                                      PIECE, **qp.scales())
    assert torch.equal(alone[0], full[row])
    idx, at = next(_batches(row))
    t = torch.tensor(idx, device=DEVICE)
    out = bi.decode_attention_fixed(q[t], *kv, pool.req_indices[t], seq_lens[t], 0.2, PIECE, **qp.scales())
    assert torch.equal(out[at], full[row])
