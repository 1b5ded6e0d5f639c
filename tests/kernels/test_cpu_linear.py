"""The CPU linear layouts (radixgen.kernels.cpu_linear, csrc/cpu_linear.h) on this CPU's build: each layout packed
from fresh random values decodes (in torch and in C) to exactly the weight those values stand for, and the C
matmul matches its reference at every row count (the streaming path up to 16 rows, the blocked GEMM past it,
each tail of both), with and without bias, bf16 and float32, output rows that fill no whole block. Every
instruction-set build runs the same checks in test_cpu_kernel_variants.py."""

from __future__ import annotations

import pytest
import torch

from radixgen.kernels import cpu, cpu_linear

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layouts(n: int, k: int, group: int, gen: torch.Generator) -> dict:
    """name -> (PackedWeight, the dense float32 weight its values stand for)."""
    w = torch.randn(n, k, generator=gen)
    q8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s8 = torch.rand(n, k // 16, generator=gen) + 0.01
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s4 = (torch.rand(n, k // group, generator=gen) * 0.1).half().float()  # fp16 exactly: stored as fp16
    m4 = (torch.randn(n, k // group, generator=gen) * 0.1).half().float()
    z4 = torch.randint(0, 17, (n, k // group), generator=gen).float()  # 16: GPTQ v1's stored 15 + 1
    s, m, z = (t.repeat_interleave(group, 1) for t in (s4, m4, z4))
    return {
        "bf16": (cpu_linear.pack_bf16(w), w.bfloat16().float()),
        "int8": (cpu_linear.pack_int8(q8, s8, 16), q8.float() * s8.repeat_interleave(16, 1)),
        "int4 offsets": (cpu_linear.pack_int4(q4, s4, m4, group, False), q4.float() * s + m),
        "int4 zero points": (cpu_linear.pack_int4(q4, s4, z4, group, True), s * (q4.float() - z)),
    }


@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (100, 192, 64), (16, 128, 128)])
def test_layouts_decode_to_their_values(n, k, group, gen):
    for name, (pw, dense) in layouts(n, k, group, gen).items():
        assert torch.equal(cpu_linear.unpack(pw), dense), name
        if name == "bf16":  # oneDNN's copy of the weight (layers/quantization/base.py: many-row matmuls on AMX)
            assert torch.equal(cpu_linear.dense_bf16(pw), dense.bfloat16()), name
        ids = torch.randint(0, n, (9,), generator=gen)
        assert torch.equal(cpu_linear.rows(pw, ids, torch.float32), dense[ids]), name
        assert torch.equal(cpu_linear.rows(pw, ids, torch.bfloat16), dense[ids].bfloat16()), name


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 17, 24, 29, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [32, 64])
def test_linear_matches_reference(m, dtype, group, gen):
    for name, (pw, _) in layouts(53, 128, group, gen).items():
        x = torch.randn(m, 128, generator=gen).to(dtype)
        bias = torch.randn(53, generator=gen).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel(cpu_linear.linear(pw, x, bias), cpu_linear.linear_ref(pw, x, bias)) < tol, (name, m)
        y = cpu_linear.linear(pw, x, float_out=True)
        assert y.dtype == torch.float32 and rel(y, cpu_linear.linear_ref(pw, x, float_out=True)) < tol, (name, m)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [144, 597])
def test_linear_over_every_split_of_the_blocks(n, threads, gen):
    """The streaming path's work split: each thread a run of blocks, in tiles of four and a shorter last one, each
    tile prefetching the next. 144 outputs are 9 blocks (4 + 5 at two threads: a tile and a tile of one), 597 are
    38 blocks with a part-filled last one, at one to three threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, (pw, _) in layouts(n, 96, 32, gen).items():
            for m in (1, 3, 8):
                x = torch.randn(m, 96, generator=gen).bfloat16()
                bias = torch.randn(n, generator=gen).bfloat16()
                assert rel(cpu_linear.linear(pw, x, bias), cpu_linear.linear_ref(pw, x, bias)) < 1e-2, (name, m)
    finally:
        torch.set_num_threads(before)


def test_gather_moves_the_weights_into_one_arena_in_order(gen):
    """cpu_linear.gather: the weights back to back in the order given (a shared one once), the arena on a 2 MiB
    boundary, each PackedWeight's data and descriptor pointing there (its holders see the move), the matmuls'
    results bit for bit the same, and the old tensors freed."""
    import weakref

    named = layouts(40, 128, 32, gen)
    weights = [pw for pw, _ in named.values()]
    x = torch.randn(3, 128, generator=gen).bfloat16()
    before = [cpu_linear.linear(pw, x) for pw in weights]
    old = [weakref.ref(pw.data) for pw in weights]
    arena = cpu_linear.gather([*weights, weights[1]])
    assert arena.data_ptr() % (2 << 20) == 0
    at = arena.data_ptr()
    for pw in weights:
        assert pw.data.data_ptr() == pw.desc.data == at and pw.data.untyped_storage().data_ptr() \
            == arena.untyped_storage().data_ptr()
        at += -(-pw.nbytes // 64) * 64
    assert at == arena.data_ptr() + arena.numel()
    assert all(torch.equal(cpu_linear.linear(pw, x), y) for pw, y in zip(weights, before, strict=True))
    assert all(r() is None for r in old)
    assert cpu_linear.gather([]) is None


def test_bf16_rounding_of_the_outputs(gen):
    """The results are rounded to bf16 once: float_out gives exactly the bf16 outputs widened."""
    pw, _ = layouts(40, 64, 32, gen)["int4 offsets"]
    for m in (3, 40):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        assert torch.equal(cpu_linear.linear(pw, x, float_out=True), cpu_linear.linear(pw, x).float())


def test_packing_checks_its_input():
    q4, s = torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack_int4(q4, torch.ones(16, 4), torch.ones(16, 4), 16, False)
    with pytest.raises(ValueError, match="scales must be"):
        cpu_linear.pack_int4(q4, torch.ones(16, 3), s, 32, False)
    with pytest.raises(ValueError, match="0..15"):
        cpu_linear.pack_int4(q4 + 16, s, s, 32, False)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_linear.pack_int8(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 5), 8)
    with pytest.raises(ValueError, match="even"):
        cpu_linear.pack_bf16(torch.ones(4, 5))
    pw = cpu_linear.pack_bf16(torch.ones(4, 8))
    with pytest.raises(ValueError, match="8 columns"):
        cpu_linear.linear(pw, torch.ones(2, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(pw, torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows only"):
        cpu_linear.linear(cpu_linear.pack_rows(torch.ones(4, 8, dtype=torch.bfloat16)), torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\)"):
        cpu_linear.rows(pw, torch.tensor([4]))


# ------------------------------------------------------------------------------------------ the AMX tile GEMM

needs_amx = pytest.mark.skipif(not (cpu.available() and cpu.lib().has_amx),
                               reason="this build or process has no AMX tile GEMM (no AMX-BF16 in the CPU or the "
                                      "native build, or the OS refused the tile state)")


@needs_amx
@pytest.mark.parametrize("k", [32, 64, 576])
@pytest.mark.parametrize("n", [16, 40, 96, 1000])
def test_amx_gemm_matches_reference(n, k, gen, poison):
    """rg_linear_amx_bf16 over every layout at row counts around its 16-row tiles and 2 x 2 tile blocks (M tails
    through the zero-padded staging tile), output counts that fill no whole block or pair of blocks, with and
    without bias, bf16 and float32 outputs (the bf16 results widened), every output written (poison)."""
    for name, (pw, dense) in layouts(n, k, 32, gen).items():  # dense: unpack(pw) (linear_ref's weight)
        bias = torch.randn(n, generator=gen).bfloat16()
        for m in (1, 15, 16, 17, 33, 64, 100, 257):
            x = torch.randn(m, k, generator=gen).bfloat16()
            y = cpu_linear.linear(pw, x, bias, amx=True)
            assert rel(y, torch.nn.functional.linear(x.float(), dense, bias.float()).bfloat16()) < 1e-2, (name, m)
            yf = cpu_linear.linear(pw, x, amx=True, float_out=True)
            assert yf.dtype == torch.float32 and rel(yf, (x.float() @ dense.t()).bfloat16()) < 1e-2, (name, m)
            assert torch.equal(yf, cpu_linear.linear(pw, x, amx=True).float()), (name, m)


@needs_amx
def test_amx_gemm_of_quantized_weights_is_that_of_their_bf16_values(gen):
    """An int8 / int4 weight's blocks are dequantized to bf16 (each value rounded once) and multiplied as a bf16
    K-pair weight: bit for bit the GEMM of the bf16 weight holding those values (int4 with offsets: the C panel
    takes scale * q + offset in one fused rounding, torch's unpack in two, so only close)."""
    x = torch.randn(37, 128, generator=gen).bfloat16()
    for name, (pw, dense) in layouts(53, 128, 32, gen).items():
        same = cpu_linear.linear(cpu_linear.pack_bf16(dense.bfloat16()), x, amx=True)
        y = cpu_linear.linear(pw, x, amx=True)
        assert torch.equal(y, same) if name != "int4 offsets" else rel(y, same) < 1e-2, name


@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_amx_gemm_is_batch_invariant(threads, gen):
    """A row's bits do not depend on the other rows of the call, on their count (the tiles, tails and chunks
    they fall in) nor on the thread count: each output sums the K tiles in the same order from zero."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, (pw, _) in layouts(100, 576, 64, gen).items():
            x = torch.randn(300, 576, generator=gen).bfloat16()
            bias = torch.randn(100, generator=gen).bfloat16()
            full = cpu_linear.linear(pw, x, bias, amx=True)
            for lo, hi in ((0, 1), (17, 18), (5, 37), (40, 112), (299, 300), (100, 300)):
                assert torch.equal(cpu_linear.linear(pw, x[lo:hi], bias, amx=True), full[lo:hi]), (name, lo, hi)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_amx_gemm_refuses_what_it_does_not_cover(gen):
    """An input size that is no multiple of 32 (whole K tiles), the deterministic mode's fixed summation order and
    float32 inputs: amx_covers says no, `linear` names the reason, the C entry point itself refuses."""
    kl = cpu.lib()
    pw = cpu_linear.pack_bf16(torch.randn(40, 100, generator=gen))
    assert not cpu_linear.amx_covers(kl, pw)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.linear(pw, torch.randn(20, 100).bfloat16(), amx=True)
    with pytest.raises(cpu.CKernelError, match="rg_linear_amx_bf16 failed: not supported"):
        cpu_linear._linear(kl, pw, torch.randn(20, 100).bfloat16(), None, amx=True)
    fixed = cpu_linear.pack_bf16(torch.randn(40, 64, generator=gen))
    assert cpu_linear.amx_covers(kl, fixed)
    fixed.fix_order(k_split=32)
    assert not cpu_linear.amx_covers(kl, fixed)
    with pytest.raises(cpu.CKernelError, match="not supported"):
        cpu_linear._linear(kl, fixed, torch.randn(20, 64).bfloat16(), None, amx=True)
    with pytest.raises(ValueError, match="bf16 x"):
        cpu_linear.linear(cpu_linear.pack_bf16(torch.randn(40, 64)), torch.randn(20, 64), amx=True)


def test_disable_amx_turns_the_amx_gemm_off(monkeypatch):
    """RADIXGEN_DISABLE_AMX=1: the same build reports no AMX GEMM (the runtime then routes as on a CPU without it),
    and `linear` refuses it by name."""
    monkeypatch.setenv("RADIXGEN_DISABLE_AMX", "1")
    kl = cpu.load()
    assert not kl.has_amx and not cpu_linear.amx_covers(kl, cpu_linear.pack_bf16(torch.randn(16, 32)))
    with pytest.raises(ValueError, match="AMX GEMM is not in this build or process"):
        cpu_linear.linear(cpu_linear.pack_bf16(torch.randn(16, 32)), torch.randn(8, 32).bfloat16(), amx=True, kl=kl)
