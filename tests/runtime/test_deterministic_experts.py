"""The deterministic mode's expert blocks (layers/fixed_experts.py): with every expert format the mode takes, a token
routed to some experts gets the same bits from the whole expert forward (experts and their combine) alone and in a
batch of 40 tokens that share its experts; the router's logits too. What the mode cannot keep is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixgen.kernels import _cpu_build, cpu
from radixgen.runtime.layers import fixed_experts
from radixgen.runtime.layers.moe import experts_forward
from radixgen.runtime.layers.quantization.experts import GroupedLinear, convert, grouped_method

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
E, H, INTER, T, TOP = 4, 64, 32, 40, 2  # experts, hidden, intermediate, tokens, top-k


def _kl(build: str):
    if _cpu_build.missing_flags(build):
        pytest.skip(f"this CPU cannot run the {build} build")
    return cpu.load(build)


def _block(kl, fmt: str, dtype=torch.bfloat16):
    """gate_up (E, 2 INTER, H) and down (E, H, INTER) of random weights in format `fmt` ("none", "int8", "int4") as
    the CPU ops set makes them, then through the mode's fix_experts."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n_in, n_out in ((H, 2 * INTER), (INTER, H)):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            layer = GroupedLinear(E, n_in, n_out)
        finally:
            torch.set_default_dtype(prev)
        layer.weight.data.copy_(torch.randn(E, n_out, n_in, generator=gen) / n_in ** 0.5)
        convert(layer, grouped_method(fmt, "cpu", kl, layer))
        fixed_experts.fix_experts("mlp.experts", layer, kl, 1)
        layers.append(layer)
    return layers


def _one_token_alone_and_in_a_batch(gate_up, down, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP] for _ in range(T)]).to(torch.int32)
    ids[:, 0] = 1  # every token shares expert 1 with the probe (token 5): 40 rows there, past every cut
    w = torch.softmax(torch.randn(T, TOP, generator=gen), -1)
    batch = experts_forward(x, w, ids, gate_up, down)
    for t in (5, 17):
        alone = experts_forward(x[t:t + 1], w[t:t + 1], ids[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], batch[t]), t
    return batch


@pytest.mark.parametrize(("build", "fmt", "name"), [
    ("x86-64-v3", "none", "bf16 K pairs (grouped, C), per expert"),
    ("skylake-avx512", "none", "bf16 K pairs (grouped, C), per expert"),
    ("native", "int8", "int8 (grouped, C), per expert, 16 rows a call"),
    ("x86-64-v3", "int8", "int8 (grouped, C), per expert, 16 rows a call"),
    ("native", "int4", "int4 (grouped, C), per expert, 16 rows a call"),
])
def test_each_format_gives_a_token_its_bits_in_any_batch(build, fmt, name):
    kl = _kl(build)
    gate_up, down = _block(kl, fmt)
    if kl.has_decode_step and fmt == "none":
        name = "bf16 K pairs (grouped, C)"  # the grouped C forward of AVX512-BF16 builds
    assert gate_up.method.name == name and down.method.name == name
    _one_token_alone_and_in_a_batch(gate_up, down)


def test_float32_experts_on_the_fixed_chains():
    kl = _kl("x86-64-v3")
    gate_up, down = _block(kl, "none", torch.float32)
    assert gate_up.method.name == "float32 fixed chains (per expert, C)"
    w0 = gate_up.method.dequantize(gate_up, 0)
    out = _one_token_alone_and_in_a_batch(gate_up, down, torch.float32)
    assert out.dtype == torch.float32 and w0.shape == (2 * INTER, H)


def test_gguf_stacks_keep_a_rows_bits_past_the_panel_gemm():
    """GGUF stacks per expert from their blocks, Q4_0 / Q4_1 among them (their panel GEMM starts at 9 rows):
    calls of at most 8 rows, and a row of 40 on one expert has the bits it has alone."""
    pytest.importorskip("gguf")
    import gguf
    from test_gguf_experts import K, layer_of, stack

    kinds = {"q": (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1),
             "mxfp4": (gguf.GGMLQuantizationType.MXFP4,), "k": (gguf.GGMLQuantizationType.Q4_K,)}
    kl = cpu.lib()
    for key, ts in kinds.items():
        gen = np.random.default_rng(7)
        layer = layer_of("cpu", [stack(f"ffn_{i}_exps", t, 32, gen) for i, t in enumerate(ts)])
        fixed_experts.fix_experts("mlp.experts.gate_up", layer, kl, 1)
        assert layer.method.name.endswith(", per expert, 8 rows a call" if key == "q" else ", per expert"), key
        x = torch.randn(40, K, generator=torch.Generator().manual_seed(3)).bfloat16()
        y = layer(x, [0, 40, 0])
        for t in (0, 9, 33):
            assert torch.equal(layer(x[t:t + 1], [0, 1, 0])[0], y[t]), (key, t)


def test_the_router_runs_on_a_c_matmul():
    from radixgen.runtime.models.moe_block import Router

    kl = _kl("x86-64-v3")
    r = Router(8, H).to(torch.bfloat16)
    r.weight.data.copy_(torch.randn(8, H, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = torch.nn.functional.linear(x.float(), r.weight.float())
    fixed_experts.fix_router("mlp.gate", r, kl)
    got = r(x)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    assert all(torch.equal(r(x[t:t + 1])[0], got[t]) for t in (0, 7, 39))
    odd = Router(8, H + 1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="router mlp.gate: torch.bfloat16 weights of 65 input features"):
        fixed_experts.fix_router("mlp.gate", odd, kl)


def test_what_stays_refused_is_named():
    kl = _kl("x86-64-v3")
    layer = GroupedLinear(E, H + 1, INTER)  # bf16 of an odd input size: no K pairs; the torch reference
    layer.weight.data, layer.dtype = layer.weight.data.bfloat16(), torch.bfloat16
    layer.method = grouped_method("none", "cpu", kl, layer)
    with pytest.raises(ValueError, match="experts of layers.0.mlp.experts.gate_up as dense .grouped, torch."):
        fixed_experts.fix_experts("layers.0.mlp.experts.gate_up", layer, kl, 1)
    gate_up, _ = _block(kl, "int8")
    with pytest.raises(ValueError, match="expert blocks at tp_size=2: the ranks' partial sums of layers.0"):
        fixed_experts.fix_experts("layers.0.mlp.experts.gate_up", gate_up, kl, 2)
