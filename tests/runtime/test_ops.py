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
from radixgen.runtime.layers.linear import DENSE, ColumnParallelLinear
from radixgen.runtime.layers.ops import CpuOps, OpsLayer, TorchOps, TritonOps, ops_for
from radixgen.runtime.layers.quantization.base import CpuPackedLinear
from radixgen.runtime.layers.quantization.unquantized import ONEDNN
from radixgen.runtime.layers.rotary import RotaryEmbedding

needs_c = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_ops_chosen_per_device():
    assert type(ops_for("cuda")) is TritonOps and type(ops_for("cuda").attention) is TritonAttentionBackend
    assert type(ops_for("cpu", disable_cpu_kernels=True)) is TorchOps
    torch_ops = ops_for("cpu", disable_cpu_kernels=True)
    assert type(torch_ops.attention) is TorchAttentionBackend and torch_ops.kernels is None
    cpu_ops = ops_for("cpu")
    assert type(cpu_ops) is CpuOps and cpu_ops.kl is cpu.lib() and cpu_ops.kernels is cpu.lib()
    if cpu_ops.kl is not None:
        assert type(cpu_ops.attention) is CpuAttentionBackend


def _linear(dtype: torch.dtype) -> torch.nn.Sequential:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the runner builds its model: layers take the model's dtype
    try:
        model = torch.nn.Sequential(RotaryEmbedding(16, 32, 10000.0), ColumnParallelLinear(8, 4))
    finally:
        torch.set_default_dtype(default)
    model[1].weight.normal_()
    return model


def test_prepare_and_install_set_every_layer_and_linear_method():
    model = _linear(torch.float32)
    w = model[1].weight.detach().clone()
    assert model[0].ops is OpsLayer.ops  # plain torch until installed
    ops = CpuOps(None)  # no C kernels: float32 weights go to oneDNN
    ops.prepare(model)
    ops.install(model)
    assert model[0].ops is ops and model[1].method is ONEDNN
    assert (model[1].weight is None) == (model[1].packed is not None)  # one copy: oneDNN's, where it applies
    x = torch.randn(3, 8)
    assert torch.allclose(model[1](x), x @ w.t(), atol=1e-5)
    assert torch.equal(model[1].method.dequantize(model[1]), w)
    model = _linear(torch.float32)
    TorchOps().prepare(model)
    TorchOps().install(model)
    assert model[1].method is DENSE and model[1].packed is None and model[1].weight is not None


@needs_c
def test_cpu_bf16_linears_hold_the_k_pair_layout_only():
    if not cpu.lib().has_decode_step:
        pytest.skip("the K-pair layout needs AVX512-BF16")
    model = _linear(torch.bfloat16)
    w = model[1].weight.detach().clone()
    ops = CpuOps(cpu.lib())
    ops.prepare(model)
    ops.install(model)
    layer = model[1]
    assert isinstance(layer.method, CpuPackedLinear) and layer.weight is None
    assert layer.packed.nbytes == 16 * 8 * 2  # 4 rows padded to a block of 16
    assert torch.equal(layer.method.dequantize(layer), w.float())
    x = torch.randn(3, 8).bfloat16()
    assert rel(layer(x), (x.float() @ w.float().t()).bfloat16()) < 1e-2


@needs_c
def test_bf16_matmuls_of_many_rows_run_on_onednn_where_it_has_amx(monkeypatch):
    """Where the AMX GEMM does not cover a layer (here: 8 input columns, no whole K tile), from ONEDNN_MIN_ROWS rows
    a bf16 K-pair layer multiplies on oneDNN (AMX tiles) over the weight copied out of its layout, and gives the C
    matmul's values within bf16 rounding; fewer rows, the deterministic mode and the builds for other CPUs stay on
    the C kernels."""
    from radixgen.kernels import cpu_linear
    from radixgen.runtime.layers import fixed_order
    from radixgen.runtime.layers.quantization import base

    if not cpu.lib().has_decode_step:
        pytest.skip("the K-pair layout needs AVX512-BF16")
    model = _linear(torch.bfloat16)
    ops = CpuOps(cpu.lib())
    ops.prepare(model)
    ops.install(model)
    layer = model[1]
    assert layer.method.amx_rows == 0  # K = 8
    assert layer.method.onednn_rows == (base.ONEDNN_MIN_ROWS if base.onednn_has_amx() else 0)
    assert torch.equal(cpu_linear.dense_bf16(layer.packed).float(), layer.method.dequantize(layer))
    layer.method.onednn_rows = 8  # whatever this CPU has: the route itself
    calls = []
    real = cpu_linear._linear
    monkeypatch.setattr(cpu_linear, "_linear", lambda *a, **kw: calls.append(a[2].shape[0]) or real(*a, **kw))
    x = torch.randn(2, 5, 8).bfloat16()  # 10 rows
    ref = (x.float() @ layer.method.dequantize(layer).t()).bfloat16()
    y = layer(x)
    assert calls == [] and y.shape == (2, 5, 4) and rel(y, ref) < 1e-2
    assert rel(layer(x[0]), ref[0]) < 1e-2 and calls == [5]  # 5 rows: the C matmul
    fixed_order.install(model, cpu.lib())
    assert layer.method.onednn_rows == 0
    monkeypatch.setattr(base, "onednn_has_amx", lambda: True)
    assert CpuPackedLinear(cpu.load("cooperlake"), None).onednn_rows == 0  # an emulated CPU without AMX


@needs_c
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_prefill_matmuls_of_8_rows_or_more_run_on_the_amx_gemm(monkeypatch, fmt):
    """Where the build and process have the AMX GEMM, a layer it covers (input size a multiple of 32; bf16, int8
    or int4) multiplies prefill inputs of AMX_MIN_ROWS rows or more on it (never on oneDNN's copy), within bf16
    rounding of the C matmul; fewer rows, decode steps and draft verifications (any row count) stay on the C
    kernels, and so does every row count in the deterministic mode; builds for other CPUs have no AMX route."""
    from radixgen.kernels import cpu_linear
    from radixgen.runtime.ground import forward_context
    from radixgen.runtime.layers import fixed_order
    from radixgen.runtime.layers.quantization import base, int4, int8

    kl = cpu.lib()
    if not kl.has_decode_step:
        pytest.skip("the K-pair layout needs AVX512-BF16")
    def packed(kl):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = ColumnParallelLinear(64, 40)
        finally:
            torch.set_default_dtype(default)
        layer.weight.normal_()
        layer.method = CpuPackedLinear(kl, {"bf16": None, "int8": int8.INT8, "int4": int4.INT4}[fmt])
        layer.method.process_weights(layer)
        return layer

    assert packed(cpu.load("cooperlake")).method.amx_rows == 0  # the build of a CPU without AMX
    layer = packed(kl)
    assert layer.method.amx_rows == (base.AMX_MIN_ROWS if kl.has_amx else 0)
    if not kl.has_amx:
        pytest.skip("this build or process has no AMX tile GEMM")
    routes = []
    real = cpu_linear._linear
    monkeypatch.setattr(cpu_linear, "_linear", lambda *a, amx=False, **kw: routes.append((a[2].shape[0], amx))
                        or real(*a, amx=amx, **kw))
    monkeypatch.setattr(cpu_linear, "dense_bf16", lambda pw: pytest.fail("oneDNN's copy of a layer AMX covers"))
    w = layer.method.dequantize(layer)
    for m in (7, 8, 100):
        x = torch.randn(m, 64).bfloat16()
        assert rel(layer(x), (x.float() @ w.t()).bfloat16()) < 1e-2
    assert routes == [(7, False), (8, True), (100, True)]
    routes.clear()
    for decode, verify in ((True, False), (False, True)):
        monkeypatch.setattr(forward_context, "_current", type("Ctx", (), {"is_decode": decode, "verify": verify}))
        layer(torch.randn(100, 64).bfloat16())
    monkeypatch.setattr(forward_context, "_current", None)
    assert routes == [(100, False), (100, False)]
    if fmt == "bf16":  # the deterministic mode keeps the C matmuls' fixed order (a model of bf16 layers only)
        routes.clear()
        fixed_order.install(torch.nn.Sequential(layer), kl)
        assert layer.method.amx_rows == layer.method.onednn_rows == 0
        layer(torch.randn(100, 64).bfloat16())
        assert routes == [(100, False)]


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


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_verification_rows_attend_bit_for_bit_as_decode_steps(dtype):
    """A verification's rows (each request's last token and its drafts) attend as the decode steps that would
    otherwise have computed them, one token a step: the same kernel, the same split of each context, so that
    speculative decoding leaves outputs bit for bit (a different kernel rounds differently, and a seeded request
    then samples another token at a near-tie of its draw)."""
    from radixgen.runtime.ground.forward_context import ForwardContext
    from radixgen.runtime.ground.kv_pool import KVPool

    gen = torch.Generator().manual_seed(0)
    h, hkv, d, prefixes, new = 6, 2, 64, [300, 41], [3, 2]  # per request: tokens in the pool, rows verified
    pool = KVPool(1, 512, hkv, d, dtype, torch.device("cpu"))
    table = torch.zeros(2, 400, dtype=torch.int64)
    table[0, :303], table[1, :43] = torch.arange(1, 304), torch.arange(304, 347)
    rows = torch.tensor([0, 1])
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    t = sum(new)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv))
    slots = torch.cat([table[b, p:p + e] for b, (p, e) in enumerate(zip(prefixes, new, strict=True))])

    def run(step_rows: list[int], prefix_lens, extend_lens, verify):
        be = CpuAttentionBackend(cpu.lib())
        ctx = ForwardContext(is_decode=not verify, kv_pool=pool, out_slots=slots[step_rows], req_to_slot=table,
                             req_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens, backend=be,
                             verify=verify)
        be.prepare(ctx)
        return be.forward(q[step_rows], k[step_rows], v[step_rows], 0, d ** -0.5, ctx)

    verified = run(list(range(t)), prefixes, new, True)
    for i in range(max(new)):  # decode steps of both requests, the second stopping after its 2 rows
        if i >= min(new):  # one request alone splits its context differently: not the verification's step
            break
        step = run([sum(new[:b]) + i for b in range(2)], [p + i for p in prefixes], [1, 1], False)
        assert torch.equal(step, verified[[sum(new[:b]) + i for b in range(2)]]), i
