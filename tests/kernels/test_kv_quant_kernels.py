"""8-bit KV pools (radixgen.kernels.kv_quant: int8 and fp8 e4m3 codes, a bf16 scale per (slot, head)): the torch
reference's quantization error, and every kernel that writes or reads such a pool against its torch reference on
fresh random inputs: the KV store bit for bit (C, Triton), decode and extend attention (C kernels of this CPU's
build, Triton under the interpreter) within the tolerance of their unquantized versions. Every instruction-set
build of the C kernels is checked in test_cpu_kernel_variants.py."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import CODE_DTYPES, DEVICE, TOL, lens_tensor, make_pool, quantize_pool, rel_err

from radixgen import kernels
from radixgen.kernels import cpu
from radixgen.kernels.kv_quant import QMAX, dequantize_kv_ref, quantize_kv_ref

C_OK = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")
C_EXTEND_OK = pytest.mark.skipif(not cpu.extend_attention_supported(cpu.lib(), torch.bfloat16, 64),
                                 reason="the CPU extend kernel needs AVX512-BF16")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def rows_with_range(gen, n: int, heads: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose magnitudes span 1e-4 .. 1e3 (fp8 subnormal codes included), one all-zero row."""
    x = torch.randn(n, heads, d, generator=gen) * torch.logspace(-4, 3, n)[:, None, None]
    x[0, 0] = 0
    return x.to(dtype)


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_reference_quantization_error(code_dtype, gen):
    """int8: every value within half a step (scale / 2); e4m3: within 2^-4 of its magnitude (3 mantissa bits) or
    half the smallest subnormal step. Scales are amax / QMAX rounded to bf16; codes never exceed QMAX."""
    x = rows_with_range(gen, 64, 3, 64, torch.float32)
    codes, scales = quantize_kv_ref(x, code_dtype)
    assert codes.dtype == code_dtype and scales.dtype == torch.bfloat16 and scales.shape == (64, 3)
    back = dequantize_kv_ref(codes, scales)
    s = scales.float().unsqueeze(-1)
    err = (back - x).abs()
    if code_dtype == torch.int8:
        assert (err <= s / 2 * (1 + 1e-6)).all()
        assert codes.abs().max() <= 127
    else:
        assert (err <= torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)).all()
        assert codes.float().abs().max() <= 448
    assert torch.equal(scales.float(), (x.abs().amax(-1) / QMAX[code_dtype]).to(torch.bfloat16).float())
    assert (back[0, 0] == 0).all() and scales[0, 0] == 0


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["c", "triton"])
def test_store_kv_quantizes_like_the_reference(impl, dtype, code_dtype, gen, request):
    if impl == "c" and not cpu.available():
        pytest.skip("CPU kernels unavailable")
    if impl == "triton":
        request.getfixturevalue("triton")
    t, hkv, d = 9, 3, 40
    k, v = rows_with_range(gen, t, hkv, d, dtype), torch.randn(t, hkv, d, generator=gen).to(dtype)
    wide = torch.cat([k, v], dim=1).to(DEVICE)  # strided rows, as the model passes them
    k, v = wide[:, :hkv], wide[:, hkv:]
    slots = (torch.randperm(39, generator=gen)[:t] + 1).to(DEVICE)
    pools = [[torch.zeros(40, hkv, d, dtype=code_dtype, device=DEVICE) for _ in range(2)]
             + [torch.zeros(40, hkv, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)] for _ in range(2)]
    store = cpu.store_kv if impl == "c" else kernels.store_kv
    for fn, (kb, vb, ks, vs) in zip((store, kernels.store_kv_ref), pools, strict=True):
        fn(kb, vb, slots, k, v, k_scales=ks, v_scales=vs)
    for got, want in zip(*pools, strict=True):
        assert torch.equal(bits(got), bits(want))
    assert pools[0][2][slots].ne(0).any()


def _decode_inputs(gen, code_dtype, dtype, lens, num_heads=6, num_kv_heads=2, head_dim=64):
    qp = quantize_pool(make_pool(lens, num_kv_heads, head_dim, torch.float32, max_context_len=224, gen=gen),
                       code_dtype)
    wide = torch.randn(len(lens), num_heads * head_dim + 8, generator=gen).to(dtype).to(DEVICE)
    q = wide[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    return q, qp, lens_tensor(lens)


def test_reference_reads_the_dequantized_pool(gen):
    """decode_attention_ref on an 8-bit pool is the same attention over that pool's dequantized values."""
    q, qp, seq_lens = _decode_inputs(gen, torch.int8, torch.float32, [5, 40])
    p = qp.pool
    deq = [dequantize_kv_ref(c, s) for c, s in ((qp.k_codes, qp.k_scales), (qp.v_codes, qp.v_scales))]
    got = kernels.decode_attention_ref(q, qp.k_codes, qp.v_codes, p.req_to_slot, p.req_indices, seq_lens, 0.2,
                                       **qp.scales())
    want = kernels.decode_attention_ref(q, *deq, p.req_to_slot, p.req_indices, seq_lens, 0.2)
    assert rel_err(got, want) < 1e-6
    plain = kernels.decode_attention_ref(q, p.k_buffer, p.v_buffer, p.req_to_slot, p.req_indices, seq_lens, 0.2)
    assert 1e-4 < rel_err(got, plain) < 3e-2  # the quantization shows, and stays small


@C_OK
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "lens"),
                         [(6, 2, 64, [5, 70, 1]), (4, 2, 128, [200]), (3, 1, 40, [33, 2]), (4, 4, 16, [17])])
def test_c_decode_attention_on_quantized_pool(code_dtype, dtype, num_heads, num_kv_heads, head_dim, lens, gen,
                                              poison):
    q, qp, seq_lens = _decode_inputs(gen, code_dtype, dtype, lens, num_heads, num_kv_heads, head_dim)
    args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, seq_lens, 0.3)
    out = cpu.decode_attention(*args, **qp.scales())
    assert out.dtype == dtype
    assert rel_err(out, kernels.decode_attention_ref(*args, **qp.scales())) < (1e-5 if dtype == torch.float32
                                                                               else TOL[dtype])


@C_EXTEND_OK
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize(("prefix", "extend"), [([0], [40]), ([24, 0, 5], [16, 1, 33])])
def test_c_extend_attention_on_quantized_pool(code_dtype, prefix, extend, gen, poison):
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    qp = quantize_pool(make_pool(lens, 2, 64, torch.bfloat16, max_context_len=96, gen=gen), code_dtype)
    q = torch.randn(sum(extend), 6, 64, generator=gen).to(torch.bfloat16)
    args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, torch.tensor(prefix),
            torch.tensor(extend), 0.2)
    out = cpu.extend_attention(*args, **qp.scales())
    assert rel_err(out, kernels.extend_attention_ref(*args, **qp.scales())) < TOL[torch.bfloat16]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention_on_quantized_pool(triton, code_dtype, dtype, gen, poison):
    q, qp, seq_lens = _decode_inputs(gen, code_dtype, dtype, [37, 1, 16], num_heads=6, head_dim=16)
    args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, seq_lens, 0.3)
    out = kernels.decode_attention(*args, num_kv_splits=2, **qp.scales())
    assert rel_err(out, kernels.decode_attention_ref(*args, **qp.scales())) < TOL[dtype]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_extend_attention_on_quantized_pool(triton, code_dtype, dtype, gen, poison):
    prefix, extend = [0, 21, 5], [7, 20, 1]
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    qp = quantize_pool(make_pool(lens, 2, 16, torch.float32, gen=gen), code_dtype)
    q = torch.randn(sum(extend), 6, 16, generator=gen).to(dtype).to(DEVICE)
    args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, lens_tensor(prefix),
            lens_tensor(extend), 0.25)
    out = kernels.extend_attention(*args, **qp.scales())
    assert rel_err(out, kernels.extend_attention_ref(*args, **qp.scales())) < TOL[dtype]


@pytest.mark.parametrize("fn", ["c", "ref"])
def test_bad_pools_are_clear_errors(fn, gen):
    q, qp, seq_lens = _decode_inputs(gen, torch.int8, torch.float32, [4])
    decode = cpu.decode_attention if fn == "c" else kernels.decode_attention_ref
    if fn == "c" and not cpu.available():
        pytest.skip("CPU kernels unavailable")
    base = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, seq_lens, 0.3)
    with pytest.raises(ValueError, match="needs k_scales"):
        decode(*base)
    with pytest.raises(ValueError, match=r"k_scales must be \(slots, kv heads\)"):
        decode(*base, k_scales=qp.k_scales[:-1], v_scales=qp.v_scales)
    with pytest.raises(ValueError, match="k_scales dtype"):
        decode(*base, k_scales=qp.k_scales.float(), v_scales=qp.v_scales)
    plain = (q, qp.pool.k_buffer, qp.pool.v_buffer, *base[3:])
    with pytest.raises(ValueError, match="for an 8-bit pool"):
        decode(*plain, **qp.scales())
    with pytest.raises(ValueError, match="k_buffer dtype"):
        decode(q, qp.k_codes.to(torch.int16), qp.v_codes.to(torch.int16), *base[3:], **qp.scales())
