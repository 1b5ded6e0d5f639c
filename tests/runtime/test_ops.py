"""The device ops sets (radixgen.runtime.layers.ops): which one a device gets, and CpuOps against TorchOps, op by
op, both where the C kernels take the input and where they do not (another dtype, a 3-D norm input, strided
heads, positions of another dtype): there CpuOps must give exactly the torch op's result. The whole-model paths
are tested in test_model_forward.py (CpuOps and TorchOps against transformers) and
tests/kernels/test_runtime_triton_path.py (TritonOps)."""

from __future__ import annotations

import pytest
import torch

from radixgen.kernels import cpu
from radixgen.runtime.layers.attention import CpuAttentionBackend, TorchAttentionBackend, TritonAttentionBackend
from radixgen.runtime.layers.linear import DENSE, ONEDNN_PACKED, ColumnParallelLinear
from radixgen.runtime.layers.ops import CpuOps, OpsLayer, TorchOps, TritonOps, ops_for
from radixgen.runtime.layers.rotary import RotaryEmbedding

needs_c = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_ops_chosen_per_device():
    assert type(ops_for("cuda")) is TritonOps and type(ops_for("cuda").attention) is TritonAttentionBackend
    assert type(ops_for("cpu", disable_cpu_kernels=True)) is TorchOps
    torch_ops = ops_for("cpu", disable_cpu_kernels=True)
    assert type(torch_ops.attention) is TorchAttentionBackend and torch_ops.linear_method is DENSE
    cpu_ops = ops_for("cpu")
    assert type(cpu_ops) is CpuOps and cpu_ops.linear_method is ONEDNN_PACKED
    assert cpu_ops.kl is cpu.lib()
    if cpu_ops.kl is not None:
        assert type(cpu_ops.attention) is CpuAttentionBackend


def test_install_sets_every_layer_and_linear_method():
    model = torch.nn.Sequential(RotaryEmbedding(16, 32, 10000.0), ColumnParallelLinear(8, 4))
    model[1].weight.normal_()
    assert model[0].ops is OpsLayer.ops  # plain torch until installed
    ops = CpuOps(None)
    ops.install(model)
    assert model[0].ops is ops and model[1].method is ONEDNN_PACKED
    x = torch.randn(3, 8)
    assert torch.allclose(model[1](x), x @ model[1].weight.t(), atol=1e-5)
    TorchOps().install(model)
    assert model[1].method is DENSE and model[1].packed is None


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_ops_match_torch_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    c, t = CpuOps(cpu.lib()), TorchOps()
    tol = TOL[dtype]
    x = torch.randn(5, 64, generator=gen).to(dtype)
    w = torch.randn(64, generator=gen).to(dtype)
    res = torch.randn(5, 64, generator=gen).to(dtype)
    assert rel(c.rms_norm(x, w, 1e-6), t.rms_norm(x, w, 1e-6)) <= tol
    x3 = x.view(5, 4, 16)  # per-head norms (Qwen3's q/k norms): not the C kernel's shape
    assert torch.equal(c.rms_norm(x3, w[:16], 1e-6), t.rms_norm(x3, w[:16], 1e-6))
    (co, cr), (to, tr) = c.add_rms_norm(x, res.clone(), w, 1e-6), t.add_rms_norm(x, res.clone(), w, 1e-6)
    assert rel(co, to) <= tol and torch.equal(cr, tr)
    gu = (3 * torch.randn(4, 2 * 48, generator=gen)).to(dtype)
    assert torch.equal(c.silu_and_mul(gu), t.silu_and_mul(gu))
    cache = RotaryEmbedding(16, 64, 10000.0).cos_sin_cache
    qkv = torch.randn(6, 6 * 16, generator=gen).to(dtype)
    pos = torch.randint(0, 64, (6,), generator=gen)
    views = {  # q and k as views of one (6, 6 heads x 16) buffer, the way the model passes them
        "contiguous heads": lambda b: (b[:, :64].view(6, 4, 16), b[:, 64:80].view(6, 1, 16)),
        "heads 32 apart": lambda b: (b[:, :64].view(6, 2, 32)[:, :, :16], b[:, 64:80].view(6, 1, 16)),
    }
    for positions in (pos, pos.to(torch.int32)):
        for name, view in views.items():
            tq, tk = t.rotary(positions, *view(qkv.clone()), cache)
            cq, ck = c.rotary(positions, *view(qkv.clone()), cache)
            assert rel(cq, tq) <= tol and rel(ck, tk) <= tol, (name, positions.dtype)
