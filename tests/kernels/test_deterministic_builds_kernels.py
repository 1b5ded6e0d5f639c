"""The matmul facts the deterministic mode rests on, on every build of the CPU kernels that runs here (x86-64-v3:
AVX2; skylake-avx512: AVX-512 without BF16; native): a row's bits do not depend on how many rows share the call for
bf16 K-pair weights (bf16 or float32 activations) and for the GGUF K-quant kernels; the int8 / int4 kernels, which
do not hold to that alone (another kernel past 16 rows), and the GGUF Q4_0 / Q4_1 / Q8_0 ones (a panel GEMM from 9
rows) do under layers/fixed_order.FixedRows; and the mode's float32 matmul, on every build alike."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radixgen.kernels import _cpu_build, cpu, cpu_fixed_f32, cpu_gguf, cpu_linear
from radixgen.runtime.layers.fixed_order import FixedRows
from radixgen.runtime.layers.quantization.base import CpuPackedLinear

BUILDS = ("x86-64-v3", "skylake-avx512", "native")
ROWS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 33, 64, 25)  # 200 in all: every streaming tile and the GEMMs


@pytest.fixture(scope="module", params=BUILDS)
def kl(request):
    missing = _cpu_build.missing_flags(request.param)
    if missing or not cpu.available():
        pytest.skip(f"no {request.param} build here ({missing or cpu.unavailable_reason()})")
    return cpu.load(request.param)


def _pieces_equal(f, x: torch.Tensor) -> list[int]:
    """The row counts whose call, on consecutive rows of x, gives other bits than one call over all of x."""
    whole, bad, start = f(x), [], 0
    for rows in ROWS:
        if not torch.equal(f(x[start:start + rows]), whole[start:start + rows]):
            bad.append(rows)
        start += rows
    assert start == x.shape[0]
    return bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_weights_and_k_quants_keep_a_rows_bits(kl, dtype, gen):
    k = 512
    x = torch.randn(200, k, generator=gen).to(dtype)
    pw = cpu_linear.pack_bf16(torch.randn(80, k, generator=gen) * 0.05)
    assert _pieces_equal(lambda a: cpu_linear._linear(kl, pw, a.contiguous(), None), x) == []
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    for t, nbytes in cpu_gguf.FILE_BYTES.items():
        if cpu_gguf.BLOCK_VALUES[t] != 256:
            continue  # Q4_0 / Q4_1 / Q8_0: below, under FixedRows
        raw = rng.integers(0, 256, (48, k // 256, nbytes), dtype=np.uint8)  # random blocks, sane fp16 scales:
        if t == "Q6_K":  # int8 sub-block scales, d
            raw[..., 192:208] = rng.integers(-40, 40, (48, k // 256, 16)).astype(np.int8).view(np.uint8)
            raw[..., 208:210] = np.full((48, k // 256, 1), 2e-4, np.float16).view(np.uint8)
        else:  # d, dmin
            raw[..., 0:4] = np.array([[[1e-4, 7.5e-4]]], np.float16).view(np.uint8)
        w = cpu_gguf.repack(torch.from_numpy(raw.reshape(48, -1)), t, k)
        assert _pieces_equal(lambda a, w=w: cpu_gguf._linear(kl, w, a.contiguous()), x) == [], t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_32_value_kinds_keep_a_rows_bits_in_fixed_rows(kl, kind, dtype, gen):
    """Their int8 tiles keep a row's bits up to 8 rows; from 9 (PANEL_GEMM_ROWS) a panel GEMM over float32 inputs
    rounds otherwise, so the mode's FixedRows cuts their calls at 8."""
    k, nbytes = 512, cpu_gguf.FILE_BYTES[kind]
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    raw = rng.integers(0, 256, (48, k // 32, nbytes), dtype=np.uint8)
    raw[..., 0:2] = np.full((48, k // 32, 1), 1e-3, np.float16).view(np.uint8)  # d
    if kind == "Q4_1":
        raw[..., 2:4] = np.full((48, k // 32, 1), -8e-3, np.float16).view(np.uint8)  # m
    w = cpu_gguf.repack(torch.from_numpy(raw.reshape(48, -1)), kind, k)
    inner = SimpleNamespace(name=kind, apply=lambda layer, a: cpu_gguf._linear(kl, w, a.contiguous()))
    layer = SimpleNamespace(in_features=k, out_features=48)
    method = FixedRows(inner, even_rows=False, rows=cpu_gguf.PANEL_GEMM_ROWS - 1)
    x = torch.randn(200, k, generator=gen).to(dtype)
    assert _pieces_equal(lambda a: method.apply(layer, a), x) == []
    assert _pieces_equal(lambda a: inner.apply(layer, a), x) != []  # what the cut is for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int_weights_keep_a_rows_bits_in_fixed_rows(kl, kind, dtype, gen):
    n, k = 96, 512
    s = torch.rand(n, k // 32, generator=gen) * 0.01
    if kind == "int8":
        pw = cpu_linear.pack_int8(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), s, 32)
    else:
        s = s.half().float()
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        pw = cpu_linear.pack_int4(q, s, (-8 * s).half().float(), 32, False)
    layer = SimpleNamespace(packed=pw, perm=None, bias=None, in_features=k, out_features=n)
    method = FixedRows(CpuPackedLinear(kl, SimpleNamespace(name=kind)), even_rows=False)  # as install gives it
    x = torch.randn(200, k, generator=gen).to(dtype)
    assert _pieces_equal(lambda a: method.apply(layer, a), x) == []
    # a lone row (an odd call's last one) has the bits it has beside others: no row needs doubling
    alone = torch.cat([cpu_linear._linear(kl, pw, x[i:i + 1].contiguous(), None) for i in range(32)])
    assert torch.equal(alone, method.apply(layer, x[:32]))


def test_float32_weights_keep_a_rows_bits_on_every_build(gen):
    """The mode's float32 matmul (dtype float32: layers/fixed_order.FixedFloat32): one fused multiply-add chain per
    output in input order, so a row's bits follow neither the row count nor the build (AVX-512, AVX2)."""
    n, k = 203, 384  # a partial last block of 16 outputs
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_fixed_f32.pack(w)
    assert torch.equal(cpu_fixed_f32.unpack(packed, n), w)
    assert torch.equal(cpu_fixed_f32.rows(packed, torch.tensor([0, 17, 202])), w[[0, 17, 202]])
    x = torch.randn(200, k, generator=gen)
    want, builds = None, 0
    for isa in BUILDS:
        if _cpu_build.missing_flags(isa) or not cpu.available():
            continue
        kl, builds = cpu.load(isa), builds + 1
        y = cpu_fixed_f32.linear(kl, packed, n, x, b)
        assert (y.double() - (x.double() @ w.double().t() + b.double())).abs().max() < 1e-3
        assert _pieces_equal(lambda a, kl=kl: cpu_fixed_f32.linear(kl, packed, n, a.contiguous(), b), x) == [], isa
        want = y if want is None else want
        assert torch.equal(y, want), isa
    if not builds:
        pytest.skip("no build of the CPU kernels here")
