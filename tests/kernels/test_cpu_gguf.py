"""GGUF block kernels (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0: radixgen.kernels.cpu_gguf, csrc/cpu_gguf_k.h and
cpu_gguf_q.h) on this CPU's build and the x86-64-v3 one, against the gguf package: blocks of random bytes (the
package cannot quantize K types) with sane fp16 block scales, repacked, decode (in torch and in C) to exactly the
package's `dequantize`; the matmul (int8 inputs per 32 values) matches a float32 matmul of that dequantized weight
at every row count, with ragged output sizes, and each row's result is the same bits alone and in a batch of any
size (inputs chunked past the L2 budget included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixgen.kernels import _cpu_build, cpu, cpu_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0")


def kquant_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, cols) of a block type as stored: random bytes, d about 1e-3 and dmin = 7.5 d (Q4_1's min -7.5 d:
    weights about zero-mean)."""
    gen = np.random.default_rng(seed)
    nb = cols // cpu_gguf.BLOCK_VALUES[type_name]
    raw = gen.integers(0, 256, (rows, nb, cpu_gguf.FILE_BYTES[type_name]), dtype=np.uint8)
    d = gen.uniform(0.5e-3, 1.5e-3, (rows, nb, 1))
    if type_name == "Q6_K":  # its d is last, the int8 sub-block scales before it
        raw[..., 208:210] = d.astype(np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
    if type_name in ("Q4_K", "Q5_K", "Q4_1"):
        raw[..., 2:4] = ((-7.5 if type_name == "Q4_1" else 7.5) * d).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy()).float()


def gemm(t: str, m: int) -> bool:
    """Whether m rows of type t take the panel GEMM (32-value block kinds from 9 rows, on AVX2 builds: all here)."""
    return cpu_gguf.BLOCK_VALUES[t] == 32 and m >= 9


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("t", TYPES)
def test_repacked_blocks_decode_to_the_gguf_values(t):
    raw = kquant_blocks(t, 37, 768, 1)
    w = cpu_gguf.repack(torch.from_numpy(raw), t, 768)
    ref = reference(t, raw)
    assert w.nbytes == 37 * 768 // cpu_gguf.BLOCK_VALUES[t] * cpu_gguf.BLOCK_BYTES[t] <= raw.nbytes * 1.03  # + < 3%
    assert torch.equal(cpu_gguf.unpack(w), ref)
    ids = torch.tensor([36, 0, 5, 5], dtype=torch.int64)
    assert torch.equal(cpu_gguf.rows(w, ids), ref[ids])
    assert torch.equal(cpu_gguf.rows(w, ids, torch.bfloat16), ref[ids].bfloat16())


def test_load_time_c_paths_match_torch():
    """The C repack (Q4_K / Q5_K, several parts into one weight) and Q6_K's int8 decode are the torch ones' bytes."""
    from radixgen.runtime.layers.quantization import gguf as gguf_method

    for t in ("Q4_K", "Q5_K"):
        parts = [kquant_blocks(t, rows, 512, rows) for rows in (3, 5)]
        want = cpu_gguf._repack_torch(torch.from_numpy(np.concatenate(parts)), t, 512)
        got = cpu_gguf.repack_parts([torch.from_numpy(p) for p in parts], t, 512)
        assert got.n == 8 and torch.equal(got.data, want.data), t
    raw = torch.from_numpy(kquant_blocks("Q6_K", 7, 512, 2))
    qw = gguf_method._q6_k(raw, 7, 512)
    dense = qw.q.float().reshape(7, 32, 16) * qw.scales.reshape(7, 32, 1)
    assert torch.equal(dense.reshape(7, 512), reference("Q6_K", raw.numpy()))


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize(("n", "k"), [(45, 512), (3, 256), (19, 96)])
def test_matmul_matches_the_dequantized_float32_matmul(t, n, k, gen):
    if k % cpu_gguf.BLOCK_VALUES[t]:
        pytest.skip(f"{t} rows hold blocks of {cpu_gguf.BLOCK_VALUES[t]}")
    raw = kquant_blocks(t, n, k, n + k)
    w, ref = cpu_gguf.repack(torch.from_numpy(raw), t, k), reference(t, raw)
    x = torch.randn(17, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    alone = torch.cat([cpu_gguf.linear(w, x[i:i + 1]) for i in range(17)])
    full = cpu_gguf.linear(w, x)
    for m in [*range(1, 10), 17]:
        y = cpu_gguf.linear(w, x[:m])
        if gemm(t, m):  # 32-value blocks from 9 rows: the exact float32 weights in the panel GEMM
            assert rel(y, x[:m] @ ref.T) < 1e-5, m
            assert torch.equal(y, full[:m]), m  # a row's bits do not depend on the batch (within the regime)
            continue
        # int8 inputs per 32: about 0.6% here (a few outputs alone: up to 2.6% seen, one near zero weighs more)
        assert rel(y, x[:m] @ ref.T) < (1.5e-2 if n * m >= 16 else 4e-2), m
        assert torch.equal(y, alone[:m]), m  # a row's bits do not depend on the batch
    yb = cpu_gguf.linear(w, x[:5], bias)
    assert torch.equal(yb, alone[:5] + bias)
    y16 = cpu_gguf.linear(w, x[:5].bfloat16())
    assert y16.dtype == torch.bfloat16 and rel(y16, x[:5].bfloat16().float() @ ref.T) < 2e-2


def test_rows_in_chunks_are_the_rows_alone(gen):
    """K = 8192: 4 input rows per chunk of int8 inputs, so 37 rows cross chunk boundaries."""
    raw = kquant_blocks("Q4_K", 5, 8192, 3)
    w, ref = cpu_gguf.repack(torch.from_numpy(raw), "Q4_K", 8192), reference("Q4_K", raw)
    x = torch.randn(37, 8192, generator=gen)
    y = cpu_gguf.linear(w, x)
    assert rel(y, x @ ref.T) < 1.5e-2
    assert torch.equal(y[33:34], cpu_gguf.linear(w, x[33:34]))


def test_bad_arguments_are_named():
    raw = torch.from_numpy(kquant_blocks("Q4_K", 4, 512, 0))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        cpu_gguf.repack(raw, "Q4_K", 500)
    with pytest.raises(ValueError, match="take 288 bytes"):
        cpu_gguf.repack(raw[:, :100], "Q4_K", 512)
    with pytest.raises(ValueError, match="repack takes"):
        cpu_gguf.repack(raw, "Q3_K", 512)
    w = cpu_gguf.repack(raw, "Q4_K", 512)
    with pytest.raises(ValueError, match="x must have 512 columns"):
        cpu_gguf.linear(w, torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\)"):
        cpu_gguf.rows(w, torch.tensor([4]))


@pytest.mark.skipif(_cpu_build.missing_flags("x86-64-v3") != [], reason="needs an AVX2 CPU")
def test_the_avx2_build_gives_the_same_results(gen):
    """The x86-64-v3 build (AVX2, FMA: what a CPU without AVX-512 runs) against this CPU's on every type."""
    avx2 = cpu.load("x86-64-v3")
    for t in TYPES:
        raw = kquant_blocks(t, 21, 512, 7)
        w = cpu_gguf.repack(torch.from_numpy(raw), t, 512)
        x = torch.randn(11, 512, generator=gen)
        y = cpu_gguf.linear(w, x[:8], kl=avx2)
        assert torch.allclose(y, cpu_gguf.linear(w, x[:8]), rtol=1e-5, atol=1e-5), t
        assert rel(y, x[:8] @ reference(t, raw).T) < 1.5e-2, t
        for m in (1, 2, 3, 5):  # a row's bits alone, at the front of a batch and inside one
            assert torch.equal(cpu_gguf.linear(w, x[:m], kl=avx2), y[:m]), (t, m)
            assert torch.equal(cpu_gguf.linear(w, x[m:m + 1], kl=avx2), y[m:m + 1]), (t, m)
        g = cpu_gguf.linear(w, x, kl=avx2)
        assert torch.equal(cpu_gguf.linear(w, x[:9], kl=avx2), g[:9]), t
        assert rel(g, x @ reference(t, raw).T) < (1e-5 if gemm(t, 9) else 1.5e-2), t
        assert torch.equal(cpu_gguf.rows(w, torch.arange(21), kl=avx2), reference(t, raw))


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernels built for plain x86-64 (no AVX2): the K-quant matmul's portable C path."""
    if "x86" not in _cpu_build.platform.machine():
        pytest.skip("an x86-64 build")
    out = tmp_path_factory.mktemp("portable") / "cpu_kernels-x86-64.so"
    cmd = [_cpu_build.compiler(), *_cpu_build._FLAGS, "-march=x86-64", "-shared", "-fPIC", "-o", str(out),
           str(_cpu_build.SRC_DIR / "cpu_kernels.c")]
    error = _cpu_build._run(cmd)
    assert error is None, error
    return cpu.CKernels(out, "x86-64")


@pytest.mark.parametrize("t", TYPES)
def test_the_portable_path_matches_the_reference(portable, t, gen):
    raw = kquant_blocks(t, 19, 512, 11)
    w, ref = cpu_gguf.repack(torch.from_numpy(raw), t, 512), reference(t, raw)
    x = torch.randn(6, 512, generator=gen)
    y = cpu_gguf.linear(w, x, kl=portable)
    assert rel(y, x @ ref.T) < 1.5e-2
    assert torch.equal(y[4:5], cpu_gguf.linear(w, x[4:5], kl=portable))
    assert torch.allclose(y, cpu_gguf.linear(w, x), rtol=1e-4, atol=1e-4)  # the AVX2 path, other float order
    assert torch.equal(cpu_gguf.rows(w, torch.arange(19), kl=portable), ref)
