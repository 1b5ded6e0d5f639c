"""The Triton dequantizing matmuls (radixgen.kernels.quant_matmul) against their torch references, on fresh random
packed weights: AWQ's and GPTQ's int4 layouts (GPTQ with groups in order and in activation order, v1 and v2
zeros), int8 and FP8 (including its zeros, subnormals and largest values), bf16 and float32 inputs, with and
without bias, row and column counts that fill no whole tile; and the wrappers' argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import DEVICE, TOL, rel_err

from radixgen import kernels

DTYPES = [torch.float32, torch.bfloat16]


def words(shape, gen) -> torch.Tensor:
    """Random int32 words: eight random 4-bit values each."""
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32).to(DEVICE)


def inputs(m, k, n, dtype, gen, bias):
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n", "group", "bias"), [(3, 64, 48, 32, True), (19, 96, 40, 32, False)])
def test_awq_matmul(triton, poison, gen, dtype, m, k, n, group, bias):
    x, b = inputs(m, k, n, dtype, gen, bias)
    args = (x, words((k, n // 8), gen), words((k // group, n // 8), gen),
            (torch.rand(k // group, n, generator=gen) * 0.05).half().to(DEVICE), group, b)
    assert rel_err(kernels.awq_matmul(*args), kernels.awq_matmul_ref(*args)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("zero_offset", [0, 1])
def test_gptq_matmul(triton, poison, gen, dtype, act_order, zero_offset):
    m, k, n, group = 5, 96, 56, 32
    x, b = inputs(m, k, n, dtype, gen, bias=act_order)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    args = (x, words((k // 8, n), gen), words((k // group, n // 8), gen),
            (torch.rand(k // group, n, generator=gen) * 0.05).half().to(DEVICE), g_idx.int().to(DEVICE), zero_offset, b)
    assert rel_err(kernels.gptq_matmul(*args), kernels.gptq_matmul_ref(*args)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 21])
def test_int8_and_fp8_matmuls(triton, poison, gen, dtype, m):
    k, n = 80, 36
    x, b = inputs(m, k, n, dtype, gen, bias=True)
    scales = (torch.rand(n, generator=gen) + 0.1).to(DEVICE)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    assert rel_err(kernels.int8_matmul(x, q8, scales, b), kernels.int8_matmul_ref(x, q8, scales, b)) < TOL[dtype]
    f8 = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    f8[(f8 & 0x7F) == 0x7F] = 0  # e4m3 has no inf; 0x7F / 0xFF are NaN
    f8[0, :6] = torch.tensor([0x00, 0x80, 0x01, 0x87, 0x7E, 0xFE], dtype=torch.uint8)  # zeros, subnormals, +-448
    f8 = f8.view(torch.float8_e4m3fn).to(DEVICE)
    assert rel_err(kernels.fp8_matmul(x, f8, scales, b), kernels.fp8_matmul_ref(x, f8, scales, b)) < TOL[dtype]


def test_fp8_kernel_decodes_e4m3_exactly(triton):
    """The kernel's bit decoding: zero, subnormals (m 2^-9), normals, the largest value, negatives."""
    bits = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0xB9], dtype=torch.uint8)
    want = torch.tensor([0.0, 2**-9, 7 * 2**-9, 2**-6, 1.0, 448.0, -448.0, -1.125])
    w = torch.zeros(8, 16, dtype=torch.uint8)
    w[:, 0] = bits  # y[0, n] = value of bits[n]
    x, values = torch.eye(16)[:1].to(DEVICE), w.view(torch.float8_e4m3fn).to(DEVICE)
    y = kernels.fp8_matmul(x, values, torch.ones(8).to(DEVICE))
    assert torch.equal(y[0].cpu(), want)


def test_wrappers_check_their_arguments(gen):
    x = torch.randn(2, 64)
    qw, qz, s = torch.zeros(64, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 32)
    with pytest.raises(ValueError, match="group"):
        kernels.awq_matmul(x, qw, qz, s, 48)
    with pytest.raises(ValueError, match="qzeros must be"):
        kernels.awq_matmul(x, qw, qz[:1], s, 32)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        kernels.awq_matmul(x[:, :32], qw, qz, s, 32)
    with pytest.raises(ValueError, match="g_idx"):
        kernels.gptq_matmul(x, torch.zeros(8, 32, dtype=torch.int32), qz, s, torch.zeros(32, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="scales must be"):
        kernels.int8_matmul(x, torch.zeros(5, 64, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="qweight dtype"):
        kernels.fp8_matmul(x, torch.zeros(5, 64, dtype=torch.int8), torch.ones(5))
