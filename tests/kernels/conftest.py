"""Kernel tests run natively on CUDA when there is a GPU, else under the Triton interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET before anything imports triton; radixgen.kernels itself never
imports triton at import time).
"""

import zlib

import pytest
import torch


@pytest.fixture
def triton():
    """Request this in every test that launches a Triton kernel: it skips when triton is not installed."""
    return pytest.importorskip("triton")


@pytest.fixture
def poison(monkeypatch):
    """Every float tensor torch.empty / torch.empty_like allocates during the test starts as NaN, so a
    kernel output element that is never written (or a scratch element read before it is written) shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test and parameter, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
