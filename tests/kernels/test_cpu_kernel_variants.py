"""Every instruction-set build of the C kernels (_cpu_build.ISAS: native, x86-64-v3 = AVX2, skylake-avx512 =
AVX512F without BF16, cooperlake = AVX512-BF16 without VBMI2) against the torch references: each variant is
compiled once per session into a temp dir and loaded as its own library, then every kernel it has runs on small
random inputs. The bf16-only kernels of a build without AVX512-BF16 are stubs that must refuse with an error;
where the build has them, they are checked like the others (test_cpu_kernels.py and
tests/runtime/test_cpu_decode.py test the runtime's own build in depth). Variants this CPU cannot execute are
skipped."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_testutil import CODE_DTYPES, TOL, lora_case, make_pool, quantize_pool, rel_err

from radixgen.kernels import (
    _cpu_build,
    cpu,
    cpu_fused,
    cpu_kv_copy,
    cpu_linear,
    cpu_lora,
    decode_attention_ref,
    extend_attention_ref,
    fused_add_rmsnorm_ref,
    rotary_embedding_ref_,
    store_kv_ref,
)
from radixgen.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

CTOL = {torch.float32: 1e-5, torch.bfloat16: TOL[torch.bfloat16]}
DTYPES = [torch.float32, torch.bfloat16]
@pytest.fixture(scope="session", params=sorted(_cpu_build.ISAS))
def kl(request, tmp_path_factory) -> cpu.CKernels:
    isa = request.param
    missing = _cpu_build.missing_flags(isa)
    if missing:
        pytest.skip(f"this CPU lacks {missing} for {isa}")
    return cpu.load(isa, tmp_path_factory.mktemp(f"kernels-{isa}"))


def test_each_variant_is_its_own_library(kl):
    assert kl.path.name.startswith(f"cpu_kernels-{kl.isa}-") and kl.path.parent != _cpu_build.cache_dir()
    if kl.isa in ("x86-64-v3", "skylake-avx512"):  # neither has AVX512-BF16
        assert not kl.has_decode_step
    if kl.isa == "cooperlake":
        assert kl.has_decode_step
    if kl.isa != "native":  # no other build targets AMX: its GEMM refuses there (the runtime keeps the C kernels)
        assert not kl.has_amx
        pw = cpu_linear.pack_bf16(torch.randn(16, 32))
        assert not cpu_linear.amx_covers(kl, pw)
        with pytest.raises(cpu.CKernelError, match="rg_linear_amx_bf16 failed: not supported"):
            cpu_linear._linear(kl, pw, torch.randn(8, 32).bfloat16(), None, amx=True)


@pytest.mark.parametrize(("vendor", "nta"), [("AuthenticAMD", True), ("GenuineIntel", False), ("", False)])
def test_weight_streams_prefetch_nta_only_in_an_amd_native_build(monkeypatch, vendor, nta):
    monkeypatch.setattr(_cpu_build, "cpu_vendor", lambda: vendor)
    assert ("-DRG_STREAM_NTA" in _cpu_build.flags("native")) == nta
    assert "-DRG_STREAM_NTA" not in _cpu_build.flags("x86-64-v3")
    if "avx512_bf16" in _cpu_build.cpu_flags():  # the AVX512-BF16 matmuls are in this CPU's native build: their hint
        text = _cpu_build.preprocess("native")  # (other kernels prefetch into L1 with _MM_HINT_T0 on every build)
        assert ("_MM_HINT_NTA" in text) == nta


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(kl, dtype, gen):
    k_buf, v_buf = (torch.randn(30, 2, 16, generator=gen).to(dtype) for _ in range(2))
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    slots = torch.randperm(29, generator=gen)[:5] + 1
    wide = torch.randn(5, 2 * 32 + 8, generator=gen).to(dtype)
    k, v = wide[:, :32].view(5, 2, 16), wide[:, 32:64].view(5, 2, 16)
    cpu.store_kv(k_buf, v_buf, slots, k, v, kl=kl)
    store_kv_ref(k_ref, v_ref, slots, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "lens"), [(9, 3, 64, [5, 70, 1]),
                                                                            (4, 2, 128, [200]), (3, 1, 40, [33, 2])])
def test_decode_attention(kl, dtype, num_heads, num_kv_heads, head_dim, lens, gen):
    pool = make_pool(lens, num_kv_heads, head_dim, dtype, max_context_len=224, gen=gen)
    wide = torch.randn(len(lens), num_heads * head_dim + 8, generator=gen).to(dtype)
    q = wide[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    seq_lens = torch.tensor(lens)
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, seq_lens, 0.3)
    assert rel_err(cpu.decode_attention(*args, kl=kl), decode_attention_ref(*args)) < CTOL[dtype]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_pool_kernels(kl, dtype, code_dtype, gen):
    """8-bit pools: the store gives the reference's codes and scales bit for bit; decode attention (head sizes on
    and off the vector paths) and, where the build has it, bf16 extend attention match the reference."""
    pools = [[torch.zeros(30, 2, 40, dtype=code_dtype) for _ in range(2)]
             + [torch.zeros(30, 2, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
    slots = torch.randperm(29, generator=gen)[:5] + 1
    k, v = ((torch.randn(5, 2, 40, generator=gen) * torch.logspace(-3, 2, 5)[:, None, None]).to(dtype)
            for _ in range(2))
    cpu.store_kv(*pools[0][:2], slots, k, v, k_scales=pools[0][2], v_scales=pools[0][3], kl=kl)
    store_kv_ref(*pools[1][:2], slots, k, v, k_scales=pools[1][2], v_scales=pools[1][3])
    for got, want in zip(*pools, strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    for num_heads, num_kv_heads, head_dim, lens in ((9, 3, 64, [5, 70, 1]), (3, 1, 40, [33, 2])):
        qp = quantize_pool(make_pool(lens, num_kv_heads, head_dim, torch.float32, max_context_len=96, gen=gen),
                           code_dtype)
        q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
        args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, torch.tensor(lens), 0.3)
        assert rel_err(cpu.decode_attention(*args, kl=kl, **qp.scales()),
                       decode_attention_ref(*args, **qp.scales())) < CTOL[dtype]
    if dtype != torch.bfloat16:
        return
    qp = quantize_pool(make_pool([19, 40], 2, 64, torch.float32, max_context_len=64, gen=gen), code_dtype)
    q = torch.randn(24, 6, 64, generator=gen).to(torch.bfloat16)
    args = (q, qp.k_codes, qp.v_codes, qp.pool.req_to_slot, qp.pool.req_indices, torch.tensor([11, 24]),
            torch.tensor([8, 16]), 0.2)
    if not kl.has_decode_step:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            cpu.extend_attention(*args, kl=kl, **qp.scales())
        return
    assert rel_err(cpu.extend_attention(*args, kl=kl, **qp.scales()),
                   extend_attention_ref(*args, **qp.scales())) < TOL[torch.bfloat16]


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_copy_rows(kl, dtype, code_dtype, gen):
    """The tier copies (cpu_kv_copy): values -> 8-bit codes and back give quantize_kv_ref's and
    dequantize_kv_ref's bits, head sizes on and off the vector paths."""
    for heads, dim in ((3, 64), (2, 40)):
        vals = [(torch.randn(20, heads, dim, generator=gen) * torch.logspace(-3, 2, 20)[:, None, None]).to(dtype)
                for _ in range(2)]
        codes = [torch.zeros(20, heads, dim, dtype=code_dtype) for _ in range(2)]
        scales = [torch.zeros(20, heads, dtype=torch.bfloat16) for _ in range(2)]
        src, dst = torch.randperm(20, generator=gen)[:7], torch.randperm(20, generator=gen)[:7]
        cpu_kv_copy.copy_rows(vals, src, codes, dst, dst_scales=scales, kl=kl)
        for v, c, s in zip(vals, codes, scales, strict=True):
            want_c, want_s = quantize_kv_ref(v[src], code_dtype)
            assert torch.equal(c[dst].view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(s[dst], want_s)
        back = [torch.zeros_like(v) for v in vals]
        cpu_kv_copy.copy_rows(codes, dst, back, src, src_scales=scales, kl=kl)
        for b, c, s in zip(back, codes, scales, strict=True):
            assert torch.equal(b[src], dequantize_kv_ref(c[dst], s[dst], dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])  # a multiple of 16 (vector rows) and a tail
def test_add_rmsnorm(kl, dtype, hidden, gen):
    x = torch.randn(3, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    res = torch.randn(3, hidden, generator=gen).to(dtype)
    assert rel_err(cpu.add_rmsnorm(x, w, 1e-5, kl=kl), fused_add_rmsnorm_ref(x, w, 1e-5).out) < CTOL[dtype]
    ref = fused_add_rmsnorm_ref(x, w, 1e-5, res.clone())
    out = cpu.add_rmsnorm(x, w, 1e-5, res, kl=kl)
    assert rel_err(out, ref.out) < CTOL[dtype] and torch.equal(res, ref.residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(kl, dtype, gen):
    from radixgen.runtime.layers.rotary import RotaryEmbedding

    cache = RotaryEmbedding(32, 64, 10000.0).cos_sin_cache
    qkv = torch.randn(6, 4 * 32, generator=gen).to(dtype)
    q, k = qkv[:, :96].view(6, 3, 32), qkv[:, 96:].view(6, 1, 32)
    positions = torch.randint(0, 64, (6,), generator=gen)
    q_ref, k_ref = q.clone(), k.clone()
    cpu.rotary_(positions, q, k, cache, kl=kl)
    rotary_embedding_ref_(positions, q_ref, k_ref, cache, 32)
    assert rel_err(q, q_ref) < CTOL[dtype] and rel_err(k, k_ref) < CTOL[dtype]


def test_bf16_kernels(kl, gen):
    """Extend attention, SiLU, the LoRA deltas: checked where the build has them, refused where it has not."""
    pool = make_pool([19, 40], 2, 64, torch.bfloat16, max_context_len=64, gen=gen)
    q = torch.randn(24, 6, 64, generator=gen).to(torch.bfloat16)
    args = (q, pool.k_buffer, pool.v_buffer, pool.req_to_slot, pool.req_indices, torch.tensor([11, 24]),
            torch.tensor([8, 16]), 0.2)
    x = (3 * torch.randn(5, 2 * 40, generator=gen)).to(torch.bfloat16)
    lora = lora_case(gen)
    if not kl.has_decode_step:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            cpu.extend_attention(*args, kl=kl)
        with pytest.raises(ValueError, match="AVX512-BF16"):
            cpu.silu_and_mul(x, kl=kl)
        with pytest.raises(ValueError, match="AVX512-BF16"):
            cpu_lora.lora_delta_(*lora.args(lora.y.clone()), kl=kl)
        return
    y = lora.y.clone()
    cpu_lora.lora_delta_(*lora.args(y), kl=kl)
    assert rel_err(y.float() - lora.y.float(), lora.reference().float() - lora.y.float()) < TOL[torch.bfloat16]
    assert rel_err(cpu.extend_attention(*args, kl=kl), extend_attention_ref(*args)) < TOL[torch.bfloat16]
    assert torch.equal(cpu.silu_and_mul(x, kl=kl), cpu.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layouts(kl, dtype, gen):
    """The matmul and row gather over every weight layout exist in every build (AVX512-BF16 ones have a faster
    bf16 path, AVX2 ones stream int8 / int4 weights for up to 16 rows): decode-sized row counts through each of
    the streaming path's row tiles (4, 2, 1 and their tails) and prefill-sized ones against the reference, rows
    exactly."""
    w = torch.randn(37, 64, generator=gen)
    q4 = torch.randint(0, 16, (37, 64), generator=gen, dtype=torch.uint8)
    s4, o4 = (torch.rand(37, 2, generator=gen) * 0.1).half().float(), torch.randint(0, 16, (37, 2)).float()
    for pw in (cpu_linear.pack_bf16(w),
               cpu_linear.pack_int8(torch.randint(-127, 128, (37, 64), generator=gen, dtype=torch.int8),
                                    torch.rand(37, 2, generator=gen), 32),
               cpu_linear.pack_int4(q4, s4, o4, 32, False), cpu_linear.pack_int4(q4, s4, o4, 32, True)):
        assert torch.equal(cpu_linear.rows(pw, torch.arange(37), torch.float32, kl=kl), cpu_linear.unpack(pw))
        for m in (1, 2, 3, 4, 5, 7, 16, 17, 40):
            x = torch.randn(m, 64, generator=gen).to(dtype)
            bias = torch.randn(37, generator=gen).to(dtype)
            assert rel_err(cpu_linear.linear(pw, x, bias, kl=kl), cpu_linear.linear_ref(pw, x, bias)) < CTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts(kl, dtype, gen):
    """The grouped expert forward and the routing exist in every build (over each build's matmuls)."""
    from radixgen.kernels import cpu_moe

    def experts(n, k, fmt):
        ws = [torch.randn(n, k, generator=gen) * 0.2 for _ in range(4)]
        return cpu_moe.PackedExperts([cpu_linear.pack_bf16(w) if fmt is None else fmt.quantize(w).pack() for w in ws])

    from radixgen.runtime.layers.quantization.experts import INT4_EXPERTS, INT8_EXPERTS

    for fmt in (None, INT8_EXPERTS, INT4_EXPERTS):
        gate_up, down = experts(64, 64, fmt), experts(64, 32, fmt)
        x = torch.randn(9, 64, generator=gen).to(dtype)
        w, ids = cpu_moe.moe_route(torch.randn(9, 4, generator=gen), 2, kl=kl)
        got, want = cpu_moe.moe_experts(x, w, ids, gate_up, down, kl=kl), cpu_moe.moe_experts_ref(x, w, ids, gate_up,
                                                                                                  down)
        assert rel_err(got, want) < CTOL[dtype] * 4


def test_stubs_refuse(kl):
    """Without AVX512-BF16 every bf16-only entry point exists with its real signature and reports that it is
    not supported: an exception, never a silent no-op."""
    if kl.has_decode_step:
        pytest.skip("this build has the bf16 kernels")
    for name, kw in (("rg_silu_and_mul_bf16", dict(gu=0, out=0, M=1, I=1)),
                     ("rg_lora_delta_bf16", dict.fromkeys(kl.fn("rg_lora_delta_bf16").argnames, 0)),
                     *((name, dict.fromkeys(kl.fn(name).argnames, 0))
                       for name in ("rg_extend_attention_i8_bf16", "rg_extend_attention_f8_bf16"))):
        with pytest.raises(cpu.CKernelError, match=f"{name} failed: not supported"):
            kl.fn(name)(**kw)
    step = {a: 0 for a in kl.fn("rg_decode_step_bf16").argnames}
    with pytest.raises(cpu.CKernelError, match="not supported"):
        kl.fn("rg_decode_step_bf16")(**{**step, "layers": None, "lm_head": None, "embed": None})
    with pytest.raises(ValueError, match="AVX512-BF16"):
        cpu_fused.DecodeStepWeights(kl, [], torch.ones(8, dtype=torch.bfloat16), num_heads=1, num_kv_heads=1,
                                    head_dim=8, intermediate=8, eps=1e-6,
                                    embed=cpu_linear.pack_rows(torch.ones(4, 8, dtype=torch.bfloat16)))


def test_a_build_this_cpu_cannot_run_is_refused_by_name(monkeypatch, tmp_path):
    """Loading a build that needs flags this CPU lacks raises an error naming them (instead of SIGILL in the first
    kernel), and RADIXGEN_CPU_ISA naming such a build leaves `lib()` on the torch path with that reason."""
    monkeypatch.setattr(_cpu_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert _cpu_build.missing_flags("x86-64-v3") == ["bmi2"] and _cpu_build.missing_flags("native") == []
    with pytest.raises(RuntimeError, match="cannot run the cooperlake build .* lacks avx512_bf16"):
        cpu.load("cooperlake", tmp_path)
    with pytest.raises(ValueError, match="unknown instruction set"):
        _cpu_build.missing_flags("pentium")
    monkeypatch.setenv("RADIXGEN_CPU_ISA", "skylake-avx512")
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)
    assert cpu.lib() is None and "lacks avx512bw, avx512f, avx512vl" in cpu.unavailable_reason()
