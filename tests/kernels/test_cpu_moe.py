"""The CPU expert-block kernels (csrc/cpu_moe.h, radixgen.kernels.cpu_moe): the grouped expert forward over bf16,
int8 and int4 experts against its torch reference (float32 and bf16 activations, routing edge cases, expert
parallel shards), the routing against torch's softmax / top-k, int4 experts against their dequantized weights,
and the C grouped method against the torch one inside layers.moe.experts_forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixgen.kernels import cpu, cpu_linear, cpu_moe
from radixgen.runtime.layers.moe import experts_forward
from radixgen.runtime.layers.quantization.experts import (
    INT4_EXPERTS,
    INT8_EXPERTS,
    CpuGroupedLinear,
    GroupedLinear,
    QuantizedGroupedLinear,
    grouped_method,
)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels did not build")

E, H, IW = 6, 64, 32


def packed_experts(kind: str, n: int, k: int, gen) -> cpu_moe.PackedExperts:
    ws = [torch.randn(n, k, generator=gen) * 0.2 for _ in range(E)]
    if kind == "bf16":
        return cpu_moe.PackedExperts([cpu_linear.pack_bf16(w) for w in ws])
    fmt = INT8_EXPERTS if kind == "int8" else INT4_EXPERTS
    return cpu_moe.PackedExperts([fmt.quantize(w).pack() for w in ws])


def routed(t: int, k: int, case: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    if case == "one_expert_takes_all":
        ids[:, 0] = 3
        ids[:, 1] = torch.where(ids[:, 1] == 3, 5, ids[:, 1])
    elif case == "idle_experts":  # experts 0, 1 and 4 get no token
        ids = torch.tensor([[2, 3], [5, 2], [3, 5]] * t, dtype=torch.int32)[:t]
    w = torch.rand(t, k, generator=gen)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "one_expert_takes_all", "idle_experts"])
def test_grouped_experts_match_reference(kind, dtype, case):
    gen = torch.Generator().manual_seed(0)
    gate_up, down = packed_experts(kind, 2 * IW, H, gen), packed_experts(kind, H, IW, gen)
    for t in (1, 4, 19):  # a decode row, a decode batch, a prefill
        w, ids = routed(t, 2, case, gen)
        x = torch.randn(t, H, generator=gen).to(dtype)
        got, want = cpu_moe.moe_experts(x, w, ids, gate_up, down), cpu_moe.moe_experts_ref(x, w, ids, gate_up, down)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol), (t, case)


def test_expert_parallel_shards_sum_to_the_block():
    """Experts [0, 3) and [3, 6) on two 'ranks' (first_expert) add up to all six; a token routed to none of a
    shard's experts gets zeros there."""
    gen = torch.Generator().manual_seed(1)
    gate_up, down = packed_experts("bf16", 2 * IW, H, gen), packed_experts("bf16", H, IW, gen)
    w, ids = routed(7, 2, "random", gen)
    x = torch.randn(7, H, generator=gen)
    whole = cpu_moe.moe_experts(x, w, ids, gate_up, down)
    halves = [cpu_moe.PackedExperts(p.weights[s:s + 3]) for p in (gate_up, down) for s in (0, 3)]
    a = cpu_moe.moe_experts(x, w, ids, halves[0], halves[2], first_expert=0)
    b = cpu_moe.moe_experts(x, w, ids, halves[1], halves[3], first_expert=3)
    assert torch.allclose(a + b, whole, atol=1e-5)
    none_here = (ids >= 3).all(-1)
    assert torch.equal(a[none_here], torch.zeros_like(a[none_here]))


@pytest.mark.parametrize("softmax_before, norm", [(True, False), (True, True), (False, False)])
def test_routing_matches_torch(softmax_before, norm):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(33, 8, generator=gen)
    logits[0, :] = 0.5  # an exact tie: torch.topk's order among equals is its own (on the CPU not the index
    # order); the C routing takes the lowest experts, the same weights
    w, ids = cpu_moe.moe_route(logits, 3, softmax_before, norm)
    want_w, want_ids = cpu_moe.moe_route_ref(logits, 3, softmax_before, norm)
    assert torch.equal(ids[1:], want_ids[1:]) and torch.equal(ids[0], torch.tensor([0, 1, 2], dtype=torch.int32))
    assert torch.allclose(w, want_w, atol=1e-6)


def test_int4_experts_against_their_dequantized_weights():
    """Int4Experts: group 64 (32 where the input size is no multiple of 64), packed two per byte; the C matmul of
    the packed expert equals F.linear on the dequantized weight, which is close to the float one."""
    gen = torch.Generator().manual_seed(3)
    for k, group in ((128, 64), (96, 32)):
        w = torch.randn(48, k, generator=gen)
        qw = INT4_EXPERTS.quantize(w)
        assert qw.bits == 4 and qw.group == group and int(qw.q.max()) <= 15
        dq = qw.dequantize()
        assert (dq - w).abs().max() <= qw.scales.max() * 0.51 + 1e-3  # half a step of the widest group
        pw = qw.pack()
        assert pw.nbytes == 48 * k // 2 + 48 * (k // group) * 4  # two values a byte, an fp16 scale + offset a group
        assert torch.allclose(cpu_linear.unpack(pw), dq, atol=1e-6)
        x = torch.randn(5, k, generator=gen)
        assert torch.allclose(cpu_linear.linear(pw, x), F.linear(x, dq), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple of 32"):
        INT4_EXPERTS.quantize(torch.randn(4, 40))


def layers(method_of, dtype):
    gen = torch.Generator().manual_seed(4)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        gate_up, down = GroupedLinear(E, H, 2 * IW), GroupedLinear(E, IW, H)
    finally:
        torch.set_default_dtype(default)
    for g in (gate_up, down):
        g.method = method_of(g)
        g.method.create_weights(g)
        g.weight.data.copy_(torch.randn(g.weight.shape, generator=gen) * 0.2)
        g.process_weights()
    return gate_up, down


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_experts_forward_dispatches_to_the_c_kernel(fmt):
    """With the CPU ops set the experts get the C grouped method and experts_forward one C call; the torch
    method over the same format gives the same block output."""
    kl = cpu.lib()
    dtype = torch.bfloat16 if kl.has_decode_step else torch.float32
    if fmt == "none" and not kl.has_decode_step:
        pytest.skip("bf16 experts take the C method on AVX512-BF16 builds only")
    c_layers = layers(lambda g: grouped_method(fmt, "cpu", kl, g), dtype)
    assert all(isinstance(g.method, CpuGroupedLinear) for g in c_layers)
    t_layers = layers(lambda g: grouped_method(fmt), dtype)
    assert fmt == "none" or isinstance(t_layers[0].method, QuantizedGroupedLinear)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, H, generator=gen).to(dtype)
    w, ids = routed(11, 2, "random", gen)
    calls = []
    real = cpu_moe._moe_experts
    cpu_moe._moe_experts = lambda *a: calls.append(1) or real(*a)
    try:
        got = experts_forward(x, w, ids, *c_layers)
    finally:
        cpu_moe._moe_experts = real
    want = experts_forward(x, w, ids, *t_layers)
    assert calls == [1]
    assert torch.allclose(got.float(), want.float(), atol=2e-2 * want.abs().max().item())
    for e in range(E):  # the C layout holds the torch method's weights (int4: the same fp16 scales and offsets)
        assert torch.allclose(c_layers[0].method.dequantize(c_layers[0], e),
                              t_layers[0].method.dequantize(t_layers[0], e), atol=1e-6)
