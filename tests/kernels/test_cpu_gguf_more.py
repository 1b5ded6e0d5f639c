"""GGUF Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 kernels (radixgen.kernels.cpu_gguf_more,
csrc/cpu_gguf_more.h) against the gguf package: blocks of random bytes with sane scales, read as stored; rows decode
to exactly the package's `dequantize`, and the matmul (int8 inputs per 32 values) matches a float32 matmul of that
dequantized weight at every row count, ragged output sizes included, with each row's result the same bits alone and
in a batch of any size; on this CPU's build, the AVX2 one (x86-64-v3) and the portable C one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixgen.kernels import _cpu_build, cpu, cpu_gguf_more

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
TYPES = tuple(cpu_gguf_more.KINDS)
# where each type's fp16 scales sit in its block (MXFP4's E8M0 exponent is byte 0)
F16_AT = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, bytes per row) of a type as stored: random bytes, fp16 scales about 1e-3 (MXFP4: 2^-8 .. 2^-5)."""
    gen = np.random.default_rng(seed)
    nb = cols // cpu_gguf_more.QK[type_name]
    raw = gen.integers(0, 256, (rows, nb, cpu_gguf_more.BLOCK_BYTES[type_name]), dtype=np.uint8)
    if type_name == "MXFP4":
        raw[..., 0] = gen.integers(120, 124, (rows, nb))  # 2^-8 .. 2^-5
    d = gen.uniform(0.5e-3, 1.5e-3, (rows, nb, 1))
    for i, at in enumerate(F16_AT.get(type_name, ())):  # the min about cancels the codes' mean: weights about 0
        v = d * ({"Q5_1": -15.5, "Q2_K": 1.5}[type_name] if i else 1)
        raw[..., at:at + 2] = v.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy()).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def int8_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: rounded to int8 per 32 values (scale max |x| / 127)."""
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.where(d > 0, g / torch.where(d > 0, d, 1), 0).round() * d).reshape(x.shape)


def check_matmul(t: str, n: int, k: int, rows: int, kl, seed: int = 0) -> torch.Tensor:
    """Every row count up to `rows` against the reference and against the rows one at a time; returns those."""
    gen = torch.Generator().manual_seed(seed)
    raw = blocks(t, n, k, n + k)
    w, ref = cpu_gguf_more.wrap(torch.from_numpy(raw), t, k), reference(t, raw)
    assert w.nbytes == raw.nbytes  # read as stored
    assert torch.equal(cpu_gguf_more.rows(w, torch.arange(n), kl=kl), ref)
    x = torch.randn(rows, k, generator=gen)
    alone = torch.cat([cpu_gguf_more.linear(w, x[i:i + 1], kl=kl) for i in range(rows)])
    for m in sorted({1, 2, 3, 4, 5, 7, rows}):
        y = cpu_gguf_more.linear(w, x[:m], kl=kl)
        err = (y - x[:m] @ ref.T).norm() / (x[:m].abs() @ ref.abs().T).norm()  # against the terms' size, not
        assert err < 1e-2, (t, m)  # the sum's (a few outputs can cancel to near 0): int8 inputs per 32
        assert rel(y, int8_inputs(x[:m]) @ ref.T) < 1e-5, (t, m)  # and nothing else: the sums are exact
        assert torch.equal(y, alone[:m]), (t, m)  # a row's bits do not depend on the batch
    return alone


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize(("n", "k"), [(45, 512), (3, 768)])
def test_matmul_matches_the_dequantized_float32_matmul(t, n, k):
    check_matmul(t, n, k, 9, None)


@pytest.mark.parametrize("t", ["Q5_0", "Q5_1", "IQ4_NL", "MXFP4"])
def test_a_row_of_one_block(t):
    check_matmul(t, 7, 32, 5, None)


def test_bias_bf16_and_the_threads_do_not_change_bits(gen):
    raw = blocks("Q3_K", 29, 512, 5)
    w, ref = cpu_gguf_more.wrap(torch.from_numpy(raw), "Q3_K", 512), reference("Q3_K", raw)
    x, bias = torch.randn(6, 512, generator=gen), torch.randn(29, generator=gen)
    y = cpu_gguf_more.linear(w, x)
    assert torch.equal(cpu_gguf_more.linear(w, x, bias), y + bias)
    y16 = cpu_gguf_more.linear(w, x.bfloat16())
    assert y16.dtype == torch.bfloat16 and rel(y16, x.bfloat16().float() @ ref.T) < 2e-2
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(cpu_gguf_more.linear(w, x), y), t
    finally:
        torch.set_num_threads(threads)


def test_rows_in_chunks_are_the_rows_alone(gen):
    """K = 8192: 32 input rows per chunk of int8 inputs, so 37 rows cross a chunk boundary."""
    raw = blocks("IQ4_XS", 5, 8192, 3)
    w, ref = cpu_gguf_more.wrap(torch.from_numpy(raw), "IQ4_XS", 8192), reference("IQ4_XS", raw)
    x = torch.randn(37, 8192, generator=gen)
    y = cpu_gguf_more.linear(w, x)
    assert rel(y, x @ ref.T) < 1.5e-2
    assert torch.equal(y[33:34], cpu_gguf_more.linear(w, x[33:34]))


def test_bad_arguments_are_named():
    raw = torch.from_numpy(blocks("Q2_K", 4, 512, 0))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        cpu_gguf_more.wrap(raw, "Q2_K", 500)
    with pytest.raises(ValueError, match="take 168 bytes"):
        cpu_gguf_more.wrap(raw[:, :100], "Q2_K", 512)
    with pytest.raises(ValueError, match="cpu_gguf_more takes"):
        cpu_gguf_more.wrap(raw, "Q4_K", 512)
    w = cpu_gguf_more.wrap(raw, "Q2_K", 512)
    with pytest.raises(ValueError, match="x must have 512 columns"):
        cpu_gguf_more.linear(w, torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\)"):
        cpu_gguf_more.rows(w, torch.tensor([4]))


@pytest.mark.skipif(_cpu_build.missing_flags("x86-64-v3") != [], reason="needs an AVX2 CPU")
@pytest.mark.parametrize("t", TYPES)
def test_the_avx2_build(t):
    """The x86-64-v3 build (AVX2, FMA, no VNNI: what a CPU without AVX-512 runs), ragged shapes, on every type."""
    avx2 = cpu.load("x86-64-v3")
    alone = check_matmul(t, 21, 512, 6, avx2)
    native = check_matmul(t, 21, 512, 6, None)
    assert torch.allclose(alone, native, rtol=1e-5, atol=1e-5)  # same integer sums, same float order


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernels built for plain x86-64 (no AVX2): the portable C path."""
    if "x86" not in _cpu_build.platform.machine():
        pytest.skip("an x86-64 build")
    out = tmp_path_factory.mktemp("portable") / "cpu_kernels-x86-64.so"
    cmd = [_cpu_build.compiler(), *_cpu_build._FLAGS, "-march=x86-64", "-shared", "-fPIC", "-o", str(out),
           str(_cpu_build.SRC_DIR / "cpu_kernels.c")]
    error = _cpu_build._run(cmd)
    assert error is None, error
    return cpu.CKernels(out, "x86-64")


@pytest.mark.parametrize("t", TYPES)
def test_the_portable_path(portable, t):
    alone = check_matmul(t, 19, 512, 4, portable)
    native = check_matmul(t, 19, 512, 4, None)
    assert torch.allclose(alone, native, rtol=1e-4, atol=1e-4)  # other float order
