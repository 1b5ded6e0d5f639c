"""radixgen.kernels.cpu (the C kernels of the CPU path) against their torch references on fresh random inputs:
unequal request lengths, scattered slots, GQA ratios 1/3/4, head sizes on and off the vectorised fast path,
strided inputs, float32 and bfloat16; plus argument errors and the fallback when the build fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_testutil import TOL, make_pool, rel_err

from radixgen.kernels import (
    cpu,
    decode_attention_ref,
    extend_attention_ref,
    fused_add_rmsnorm_ref,
    rotary_embedding_ref_,
    store_kv_ref,
)

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]
# fp32 kernels agree with the fp32 references to rounding; bf16 ones round their output once
CTOL = {torch.float32: 1e-5, torch.bfloat16: TOL[torch.bfloat16]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128),
                                                                     (6, 2, 16), (3, 1, 40)])
@pytest.mark.parametrize("lens", [[1], [5, 17, 33, 2], [300], [70, 1, 129]])
def test_decode_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim, lens, gen, poison):
    pool = make_pool(lens, num_kv_heads, head_dim, dtype, max_context_len=320, gen=gen)
    # q as a strided view (rows of a wider buffer), as the model passes it (a split of the qkv output)
    wide = torch.randn(len(lens), num_heads * head_dim + 24, generator=gen).to(dtype)
    q = wide[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    seq_lens = torch.tensor(lens)
    out = cpu.decode_attention(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, seq_lens, 0.3)
    ref = decode_attention_ref(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, seq_lens, 0.3)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < CTOL[dtype]


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
def test_decode_attention_splits_agree(batch, gen):
    """Long contexts of a small batch are cut into pieces merged by log-sum-exp; every split count the
    heuristic can pick gives the single-piece answer."""
    lens = torch.randint(1, 700, (batch,), generator=gen).tolist()
    pool = make_pool(lens, 2, 64, torch.float32, max_reqs=batch + 1, max_context_len=700, gen=gen)
    q = torch.randn(batch, 6, 64, generator=gen)
    seq_lens = torch.tensor(lens)
    kl = cpu.lib()
    one = None
    for threads in (1, 2, 8, 64):
        splits = cpu.num_splits(batch, max(lens), threads)
        assert splits >= 1
        out = torch.empty_like(q)
        part = torch.empty(batch * 2 * splits * 3 * 66)
        kl.fn("decode_attention", "f32")(
            q=q.data_ptr(), q_stride=q.stride(0), k_buf=pool.k_buffer.data_ptr(), v_buf=pool.v_buffer.data_ptr(),
            table=pool.req_to_slot.data_ptr(), table_stride=pool.req_to_slot.stride(0),
            rows=pool.req_indices.data_ptr(), seq_lens=seq_lens.data_ptr(), out=out.data_ptr(), B=batch, H=6, Hkv=2,
            D=64, scale=0.125, splits=splits, piece=0, part=part.data_ptr())
        one = out if one is None else one
        assert rel_err(out, one) < 1e-6
    ref = decode_attention_ref(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, seq_lens, 0.125)
    assert rel_err(one, ref) < 1e-5


EXTEND_OK = cpu.extend_attention_supported(cpu.lib(), torch.bfloat16, 64)


@pytest.mark.skipif(not EXTEND_OK, reason="the CPU extend kernel needs AVX512-BF16")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 2, 32)])
@pytest.mark.parametrize(("prefix", "extend"), [([0], [1]), ([0], [40]), ([24, 0, 5], [16, 1, 33]), ([100], [7]),
                                                ([3, 0], [130, 17])])
def test_extend_attention_matches_reference(num_heads, num_kv_heads, head_dim, prefix, extend, gen, poison):
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    pool = make_pool(lens, num_kv_heads, head_dim, torch.bfloat16, max_context_len=200, gen=gen)
    t = sum(extend)
    wide = torch.randn(t, num_heads * head_dim + 32, generator=gen).to(torch.bfloat16)
    q = wide[:, :num_heads * head_dim].view(t, num_heads, head_dim)  # strided rows, as the model passes q
    pl, el = torch.tensor(prefix), torch.tensor(extend)
    out = cpu.extend_attention(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, pl, el, 0.2)
    ref = extend_attention_ref(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, pl, el, 0.2)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(not EXTEND_OK, reason="the CPU extend kernel needs AVX512-BF16")
@pytest.mark.parametrize("scale", [0.02, 3.0])
def test_extend_attention_online_softmax_extremes(scale, gen):
    """Near-uniform and very peaked attention (scores in the hundreds): the running maximum moves by large steps
    between key blocks and hidden keys must still weigh exactly nothing."""
    prefix, extend = [19, 0], [70, 33]  # token groups of 16 with tails, a prefix that is not block-aligned
    pool = make_pool([p + e for p, e in zip(prefix, extend, strict=True)], 2, 64, torch.bfloat16,
                     max_context_len=128, gen=gen)
    t = sum(extend)
    q = (torch.randn(t, 6, 64, generator=gen) * 2).to(torch.bfloat16)
    pl, el = torch.tensor(prefix), torch.tensor(extend)
    out = cpu.extend_attention(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, pl, el, scale)
    ref = extend_attention_ref(q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, pl, el, scale)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(not EXTEND_OK, reason="the CPU extend kernel needs AVX512-BF16")
def test_extend_attention_rejects_what_it_cannot_do(gen):
    pool = make_pool([4], 2, 64, torch.bfloat16, gen=gen)
    q = torch.randn(4, 4, 64, generator=gen).to(torch.bfloat16)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices)
    with pytest.raises(ValueError, match="q dtype"):
        cpu.extend_attention(q.float(), *args, torch.tensor([0]), torch.tensor([4]), 0.1)
    with pytest.raises(ValueError, match="sum to"):
        cpu.extend_attention(q, *args, torch.tensor([0]), torch.tensor([3]), 0.1)
    pool48 = make_pool([4], 2, 48, torch.bfloat16, gen=gen)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.extend_attention(torch.randn(4, 4, 48).to(torch.bfloat16), pool48.k_buffer, pool48.v_buffer,
                             pool48.req_to_slot, pool48.req_indices, torch.tensor([0]), torch.tensor([4]), 0.1)


@pytest.mark.skipif(not EXTEND_OK, reason="the CPU SiLU kernel needs AVX512-BF16")
@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (64, 1536), (300, 24), (3, 7)])  # 7, 24: the scalar tail
def test_silu_and_mul_equals_torch_bit_for_bit(rows, n, gen, poison):
    x = (3 * torch.randn(rows, 2 * n, generator=gen)).to(torch.bfloat16)
    assert torch.equal(cpu.silu_and_mul(x), cpu.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference(dtype, gen):
    k_buf = torch.randn(40, 3, 16, generator=gen).to(dtype)
    v_buf = torch.randn(40, 3, 16, generator=gen).to(dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    slots = torch.randperm(39, generator=gen)[:7] + 1
    wide = torch.randn(7, 2 * 48 + 8, generator=gen).to(dtype)
    k, v = wide[:, :48].view(7, 3, 16), wide[:, 48:96].view(7, 3, 16)  # strided rows
    cpu.store_kv(k_buf, v_buf, slots, k, v)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_add_rmsnorm_matches_reference(dtype, with_residual, rows, gen, poison):
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype) if with_residual else None
    ref = fused_add_rmsnorm_ref(x, w, 1e-5, None if res is None else res.clone())
    out = cpu.add_rmsnorm(x, w, 1e-5, res)
    assert rel_err(out, ref.out) < CTOL[dtype]
    if with_residual:  # updated in place, rounded to the dtype exactly like the reference's sum
        assert torch.equal(res, ref.residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_matches_reference(dtype, head_dim, gen):
    from radixgen.runtime.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    t = 11
    qkv = torch.randn(t, (5 + 2 * 1) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :5 * head_dim].view(t, 5, head_dim)  # strided views of one buffer, as in the model
    k = qkv[:, 5 * head_dim:6 * head_dim].view(t, 1, head_dim)
    positions = torch.randint(0, 512, (t,), generator=gen)
    q_ref, k_ref = q.clone(), k.clone()
    cpu.rotary_(positions, q, k, rope.cos_sin_cache)
    rotary_embedding_ref_(positions, q_ref, k_ref, rope.cos_sin_cache, head_dim)
    assert rel_err(q, q_ref) < CTOL[dtype] and rel_err(k, k_ref) < CTOL[dtype]
    # the value part of the buffer is untouched
    assert torch.equal(qkv[:, 6 * head_dim:], qkv.clone()[:, 6 * head_dim:])


def test_bad_arguments_raise_clear_errors(gen):
    pool = make_pool([4], 2, 16, torch.float32, gen=gen)
    q = torch.randn(1, 4, 16, generator=gen)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices)
    with pytest.raises(ValueError, match="q dtype"):
        cpu.decode_attention(q.half(), *args, torch.tensor([4]), 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        cpu.decode_attention(torch.randn(1, 3, 16), *args, torch.tensor([4]), 0.25)
    with pytest.raises(ValueError, match="seq_lens must lie"):
        cpu.decode_attention(q, *args, torch.tensor([0]), 0.25)
    with pytest.raises(ValueError, match="sm_scale"):
        cpu.decode_attention(q, *args, torch.tensor([4]), -1.0)
    with pytest.raises(ValueError, match="slots must lie"):
        cpu.store_kv(pool.k_buffer, pool.v_buffer, torch.tensor([10_000]), torch.randn(1, 2, 16),
                     torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match="weight.shape"):
        cpu.add_rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="positions must lie"):
        cpu.rotary_(torch.tensor([600]), torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(512, 16))


def test_failed_build_falls_back_to_torch(tmp_path):
    """No compiler: the kernels report why they are unavailable, and the model runs on the torch path."""
    code = (
        "from radixgen.kernels import cpu\n"
        "assert not cpu.available()\n"
        "print(repr(cpu.unavailable_reason()))\n"
        "from radixgen.runtime.layers.ops import TorchOps, ops_for\n"
        "ops = ops_for('cpu')\n"
        "assert ops.kl is None and type(ops.attention).__name__ == 'TorchAttentionBackend'\n"
        "from radixgen.runtime.layers.norm import RMSNorm\n"
        "import torch\n"
        "norm = RMSNorm(8, 1e-6)\n"
        "norm.ops = ops\n"
        "print(norm(torch.ones(2, 8)).sum().item())\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "RADIXGEN_KERNEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "building the CPU kernels failed" in lines[0] or "no C compiler" in lines[0]
    assert float(lines[1]) == pytest.approx(16.0)


def test_arguments_are_passed_by_declared_name():
    """Every C call names its arguments: one left out, misspelt or extra is a TypeError, not a corrupt call."""
    f = cpu.lib().fn("store_kv", "f32")
    good = dict(k=0, k_stride=0, v=0, v_stride=0, k_buf=0, v_buf=0, slots=0, n_tok=0, row_elems=0)
    f(**good)  # n_tok 0: touches nothing
    with pytest.raises(TypeError, match="rg_store_kv_f32.* missing .*'row_elems'"):
        f(**{k: v for k, v in good.items() if k != "row_elems"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_tokens'"):
        f(**{("n_tokens" if k == "n_tok" else k): v for k, v in good.items()})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stride'"):
        f(**good, stride=1)
    with pytest.raises(TypeError, match="positional"):
        f(*good.values())


def test_a_failing_kernel_raises():
    """A kernel's failure status becomes an exception: the extend kernel refuses a head_dim it has no code for."""
    kl = cpu.lib()
    if not kl.has_decode_step:
        pytest.skip("needs the AVX512-BF16 build")
    with pytest.raises(cpu.CKernelError, match="rg_extend_attention_bf16 failed: not supported"):
        kl.fn("rg_extend_attention_bf16")(q=0, q_stride=0, k_buf=0, v_buf=0, table=0, table_stride=0, rows=0,
                                          prefix_lens=0, extend_lens=0, q_start=0, out=0, B=0, H=1, Hkv=1, D=48,
                                          scale=1.0, pack=0)
