"""The C row copies between KV pools (kernels.cpu_kv_copy, what ground.kv_pool.copy_kv_rows runs for CPU pools)
against the torch path (kv_pool._copy_kv_rows: index_select / index_copy per buffer, kv_quant's quantize_kv_ref and
dequantize_kv_ref): every buffer bit for bit, for bf16 and fp32 pools to and from int8, fp8 and same-format host
tiers, an 8-bit pool's codes and scales, head sizes on and off the vector paths, 1 row and many, on 1 and 2
threads; rows outside the copied ones untouched; bad arguments refused with errors naming them."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixgen.kernels import cpu, cpu_kv_copy
from radixgen.runtime.ground import kv_pool
from radixgen.runtime.ground.kv_pool import HostKVPool, KVPool, copy_kv_rows

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

ROWS = 48
LAYERS = 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16 if t.dtype.itemsize == 2 else
                                                                    torch.int32)


def same_bits(a: KVPool, b: KVPool) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a.buffers(), b.buffers(), strict=True))


def filled(pool: KVPool, gen: torch.Generator) -> KVPool:
    """Values over six orders of magnitude by (row, head) (fp8's subnormal codes too), an all-zero row; 8-bit pools
    get random codes and scales."""
    for b in pool.k_buffers + pool.v_buffers:
        if pool.code_dtype is None:
            mag = torch.logspace(-4, 2, b.shape[0] * b.shape[1])[torch.randperm(b.shape[0] * b.shape[1],
                                                                                generator=gen)]
            b.copy_(torch.randn(b.shape, generator=gen) * mag.view(b.shape[0], b.shape[1], 1))
            b[3, 0] = 0
        elif b.dtype == torch.int8:
            b.copy_(torch.randint(-127, 128, b.shape, generator=gen, dtype=torch.int8))
        else:
            bits(b).copy_(bits((torch.randn(b.shape, generator=gen) * 40).clamp(-448, 448).to(b.dtype)))
    for s in (pool.k_scales or []) + (pool.v_scales or []):
        s.copy_(torch.rand(s.shape, generator=gen) * 0.1)
    return pool


def twins(layers, heads, dim, dtype, code, gen, host: bool) -> tuple[KVPool, KVPool]:
    """Two pools with the same contents (one for each path)."""
    make = (lambda: HostKVPool(layers, ROWS, heads, dim, dtype, code)) if host else \
        (lambda: KVPool(layers, ROWS, heads, dim, dtype, code_dtype=code))
    a, b = make(), make()
    filled(a, gen)
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        bits(y).copy_(bits(x))
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("host", [torch.int8, torch.float8_e4m3fn, None], ids=["int8", "fp8", "same"])
@pytest.mark.parametrize(("heads", "dim"), [(3, 64), (1, 80), (8, 128), (3, 24)])  # 24: off the vector path
def test_the_c_copies_give_the_torch_paths_bits(dtype, host, heads, dim, gen):
    assert cpu.available()
    pool, pool_ref = twins(LAYERS, heads, dim, dtype, None, gen, host=False)
    tier, tier_ref = twins(LAYERS, heads, dim, dtype, host, gen, host=True)
    for n in (1, ROWS - 1):
        src, dst = torch.randperm(ROWS, generator=gen)[:n], torch.randperm(ROWS, generator=gen)[:n]
        copy_kv_rows(pool, src, tier, dst)  # down a tier: quantized (or a bit copy)
        kv_pool._copy_kv_rows(pool_ref, src, tier_ref, dst)
        assert same_bits(tier, tier_ref)
        back = torch.randperm(ROWS, generator=gen)[:n]
        copy_kv_rows(tier, dst, pool, back)  # and back up: dequantized
        kv_pool._copy_kv_rows(tier_ref, dst, pool_ref, back)
        assert same_bits(pool, pool_ref)


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn])
def test_an_8bit_pool_and_its_host_tier_copy_codes_and_scales(code, gen):
    pool, pool_ref = twins(LAYERS, 3, 64, torch.bfloat16, code, gen, host=False)
    tier, tier_ref = twins(LAYERS, 3, 64, torch.bfloat16, code, gen, host=True)
    src, dst = torch.randperm(ROWS, generator=gen)[:20], torch.randperm(ROWS, generator=gen)[:20]
    before = [b.clone() for b in tier.buffers()]
    copy_kv_rows(pool, src, tier, dst)
    kv_pool._copy_kv_rows(pool_ref, src, tier_ref, dst)
    assert same_bits(tier, tier_ref)
    keep = [r for r in range(ROWS) if r not in set(dst.tolist())]
    for got, old, source in zip(tier.buffers(), before, pool.buffers(), strict=True):
        assert torch.equal(bits(got[dst]), bits(source[src])) and torch.equal(bits(got[keep]), bits(old[keep]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_threads_give_one_threads_bits(dtype, gen):
    pool = filled(KVPool(LAYERS, 300, 3, 64, dtype), gen)
    tiers = [HostKVPool(LAYERS, 300, 3, 64, dtype, torch.int8) for _ in range(2)]
    backs = [KVPool(LAYERS, 300, 3, 64, dtype) for _ in range(2)]
    src, dst = torch.randperm(300, generator=gen)[:257], torch.randperm(300, generator=gen)[:257]
    kl = cpu.lib()
    for threads, tier, back in zip((1, 2), tiers, backs, strict=True):
        cpu_kv_copy._copy_rows(kl, pool.c_buffers(), src, tier.c_buffers(), dst, threads)
        cpu_kv_copy._copy_rows(kl, tier.c_buffers(), dst, back.c_buffers(), src, threads)
    assert same_bits(*tiers) and same_bits(*backs)


def test_bad_copies_are_refused():
    pool = KVPool(2, 16, 2, 16, torch.bfloat16)
    int8, fp8 = (HostKVPool(2, 16, 2, 16, torch.bfloat16, c) for c in (torch.int8, torch.float8_e4m3fn))
    idx = torch.tensor([1, 2])
    with pytest.raises(IndexError, match="destination rows must lie in"):
        copy_kv_rows(pool, idx, int8, torch.tensor([1, 16]))
    with pytest.raises(ValueError, match="2 source rows for 1 destination"):
        copy_kv_rows(pool, idx, int8, torch.tensor([1]))
    with pytest.raises(ValueError, match="no conversion from torch.int8 codes"):
        copy_kv_rows(int8, idx, fp8, idx)
    with pytest.raises(ValueError, match="pools differ"):
        copy_kv_rows(pool, idx, HostKVPool(2, 16, 2, 8, torch.bfloat16, torch.int8), idx)
    k = pool.k_buffers
    with pytest.raises(ValueError, match="src_index must lie in"):
        cpu_kv_copy.copy_rows(k, torch.tensor([-1, 2]), int8.k_buffers, idx, dst_scales=int8.k_scales)
    with pytest.raises(ValueError, match="dst_scales must be given"):
        cpu_kv_copy.copy_rows(k, idx, int8.k_buffers, idx)
    with pytest.raises(ValueError, match="no conversion from torch.int8 to torch.float8_e4m3fn"):
        cpu_kv_copy.copy_rows(int8.k_buffers, idx, fp8.k_buffers, idx, src_scales=int8.k_scales,
                              dst_scales=fp8.k_scales)
    with pytest.raises(ValueError, match="alike contiguous"):
        cpu_kv_copy.copy_rows(k, idx, [torch.zeros(16, 2, 8, dtype=torch.bfloat16)] * 2, idx)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        cpu_kv_copy.copy_rows(k, idx, pool.v_buffers, idx, threads=0)
    cpu_kv_copy.copy_rows(k, idx, pool.v_buffers, torch.tensor([5, 6]))  # the checked entry point works
    assert torch.equal(pool.v_buffers[0][5:7], pool.k_buffers[0][1:3])
