"""Mixtures of experts on the CPU kernels (bf16): the fused decode step with its expert blocks (routing, the routed
experts, Qwen2-MoE's gated shared expert inside the one C call) against the layer-by-layer path on the same
weights, whose expert blocks run the grouped C expert forward, itself against the torch path (no C kernels);
bf16, int8 and int4 experts."""

from __future__ import annotations

import pytest
import torch
from test_cpu_decode import drive, rel, runner_for
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu, cpu_fused
from radixgen.runtime.executor import cpu_decode
from radixgen.runtime.layers.quantization.experts import CpuGroupedLinear, GroupedLinear

pytestmark = pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                                reason="the fused decode step needs the CPU kernels built with AVX512-BF16")

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def prompts_for(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, 200, (n,), generator=gen).tolist()
            for n in torch.randint(1, 30, (batch,), generator=gen).tolist()]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_moe_step_matches_layer_by_layer(arch):
    folder = str(tiny_model_dir(arch))
    fused, plain = runner_for(folder), runner_for(folder)
    assert fused.fused_decode is not None and fused.fused_decode.weights.moe
    experts = [m for m in fused.model.modules() if isinstance(m, GroupedLinear)]
    assert experts and all(isinstance(m.method, CpuGroupedLinear) for m in experts)
    arena = experts[0].packed.weights[0].data.untyped_storage().data_ptr()
    for m in experts:  # moved into the ops' weight arena (cpu_linear.gather), the descriptors following
        assert all(m.packed.descs[i].data == w.data.data_ptr() for i, w in enumerate(m.packed.weights))
        assert all(w.data.untyped_storage().data_ptr() == arena for w in m.packed.weights)
    plain.fused_decode = None
    calls = []
    real = cpu_fused.decode_step
    cpu_decode.cpu_fused.decode_step = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        for batch in (1, 5):
            got, k_got, _ = drive(fused, prompts_for(batch), 5)
            want, k_want, _ = drive(plain, prompts_for(batch), 5)
            assert rel(got, want) < 1e-2, batch
            assert torch.equal(got.argmax(-1), want.argmax(-1)), batch
            for kg, kw in zip(k_got, k_want, strict=True):
                assert rel(kg.float(), kw.float()) < 1e-2
    finally:
        cpu_decode.cpu_fused.decode_step = real
    assert len(calls) == 10  # every decode step took the fused path


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_step_with_quantized_experts(fmt):
    """bf16 experts quantized after loading (experts.convert) run in the fused step as layer by layer; the torch
    method over the same format (its dequantized reference) gives the same block outputs."""
    from radixgen.runtime.layers.quantization.experts import _FORMATS, QuantizedGroupedLinear, convert

    folder = str(tiny_model_dir("qwen2_moe"))
    fused, plain, ref = runner_for(folder), runner_for(folder), runner_for(folder)
    for r in (fused, plain):
        for m in r.model.modules():
            if isinstance(m, GroupedLinear):
                convert(m, CpuGroupedLinear(m.method.kl, _FORMATS[fmt]))
    for m in ref.model.modules():
        if isinstance(m, GroupedLinear):
            convert(m, QuantizedGroupedLinear(_FORMATS[fmt]))
    fused.fused_decode = cpu_decode.FusedDecode.build(fused.model, fused.kv_pool, fused.fused_decode.kl)
    plain.fused_decode = ref.fused_decode = None
    got, want, torch_ref = (drive(r, prompts_for(3), 4)[0] for r in (fused, plain, ref))
    assert rel(got, want) < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert rel(want, torch_ref) < 2e-2
