"""Q4_0 / Q4_1 / Q8_0 decode rows (up to 8) on the task pool (csrc/cpu_task_pool.h, cpu_gguf_q.h gq_linear): the
same bits at every thread count and for each row alone, close to a float32 matmul of the dequantized blocks; the
bf16 entry (rg_gguf_q_linear_bf16) gives exactly the float32 entry's outputs rounded to bf16; a forked child
(whose parent's pool threads are gone) still computes, with its own workers. This CPU's build and the x86-64-v3
one (AVX2: the build these decode steps run on where the fused AVX512-BF16 step does not exist)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixgen.kernels import _cpu_build, cpu, cpu_gguf

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
TYPES = ("Q4_0", "Q4_1", "Q8_0")


def blocks(t: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of type t as stored (random codes, d about 1e-3, Q4_1's min -7.5 d) and its float32 values."""
    gen = np.random.default_rng(seed)
    nb, nbytes = cols // 32, cpu_gguf.FILE_BYTES[t]
    raw = gen.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    d = gen.uniform(0.5e-3, 1.5e-3, (rows, nb, 1)).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8)
    d = d.astype(np.float32)
    if t == "Q8_0":
        values = d * raw[..., 2:].view(np.int8).astype(np.float32)
    else:
        qs = raw[..., 4:] if t == "Q4_1" else raw[..., 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
        if t == "Q4_1":
            m = (-7.5 * d).astype(np.float16)
            raw[..., 2:4] = m.view(np.uint8)
            values = d * q + m.astype(np.float32)
        else:
            values = d * (q - 8)
    return torch.from_numpy(raw.reshape(rows, -1)), torch.from_numpy(values.reshape(rows, cols))


def builds() -> list[cpu.CKernels]:
    out = [cpu.lib()]
    if not _cpu_build.missing_flags("x86-64-v3"):
        out.append(cpu.load("x86-64-v3"))
    return out


@pytest.mark.parametrize("t", TYPES)
def test_decode_rows_are_the_same_bits_at_any_thread_count(t):
    raw, ref = blocks(t, 301, 576, 3)  # 301 outputs: many chunks of 32, a ragged last one
    w = cpu_gguf.repack(raw, t, 576)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for kl in builds():
            torch.set_num_threads(1)
            one = cpu_gguf.linear(w, x, kl=kl)
            assert ((one - x @ ref.T).norm() / (x @ ref.T).norm()).item() < 1.5e-2, kl.isa
            for n in (2, 3):
                torch.set_num_threads(n)
                for _ in range(3):  # the pool's workers claim different chunks from call to call
                    assert torch.equal(cpu_gguf.linear(w, x, kl=kl), one), (kl.isa, n)
                assert torch.equal(cpu_gguf.linear(w, x[5:6], kl=kl), one[5:6]), (kl.isa, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("t", TYPES)
def test_bf16_rows_are_the_float32_rows_rounded(t):
    raw, _ = blocks(t, 77, 320, 5)
    w = cpu_gguf.repack(raw, t, 320)
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(2)).bfloat16()
    for kl in builds():
        for m in (1, 4, 8, 9):  # 9 rows: the float32 path (the GEMM), as before
            y = cpu_gguf.linear(w, x[:m], kl=kl)
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, cpu_gguf.linear(w, x[:m].float(), kl=kl).bfloat16()), (kl.isa, m)


def test_a_forked_child_runs_the_pool_with_its_own_threads():
    raw, _ = blocks("Q4_1", 200, 256, 7)
    w = cpu_gguf.repack(raw, "Q4_1", 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = cpu_gguf.linear(w, x)  # the parent's pool started
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if its result is the parent's
            ok = all(torch.equal(cpu_gguf.linear(w, x), want) for _ in range(3))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)
