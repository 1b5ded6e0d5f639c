"""GGUF expert stacks run per expert from their own blocks (layers/quantization/gguf_experts.py): MXFP4, K-quants and
the other kinds of the per-linear C kernels, gate and up of two kinds, against their dequantized values; and the C
row readers that dequantize a GGUF tensor (GGUFTensor.dense) give the gguf package's values bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_more import blocks

from radixgen.kernels import cpu
from radixgen.runtime.layers.quantization.experts import GroupedLinear, grouped_method
from radixgen.runtime.layers.quantization.gguf import C_DENSE, GGUFStack, GGUFTensor

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
E, K, ROWS = 3, 256, 64  # experts, input columns, rows per part


def stack(name: str, t, rows: int, gen) -> GGUFStack:
    raw = np.stack([blocks(t, rows, K, gen) for _ in range(E)])
    return GGUFStack(name, t.name, torch.from_numpy(raw), K)


def layer_of(ops: str, parts: list[GGUFStack]) -> GroupedLinear:
    """A GroupedLinear of E experts whose rows are `parts` in order (gate, up), loaded as Experts loads a file."""
    kl = cpu.lib() if ops == "cpu" else None
    layer = GroupedLinear(E, K, sum(p.shape[1] for p in parts))
    layer.method = grouped_method("gguf", ops, kl, layer)
    layer.method.create_weights(layer)
    row = 0
    for p in parts:
        for e, t in enumerate(p):
            layer.method.load(layer, e, row, t)
        row += p.shape[1]
    layer.process_weights()
    return layer


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
@pytest.mark.parametrize("kinds", [(T.MXFP4,), (T.Q4_K, T.Q6_K), (T.IQ4_XS,), (T.Q5_0, T.Q2_K), (T.Q4_0, T.Q4_1)])
def test_expert_stacks_run_per_expert_from_their_blocks(kinds):
    gen = np.random.default_rng(7)
    parts = [stack(f"ffn_{i}_exps", t, ROWS, gen) for i, t in enumerate(kinds)]
    layer = layer_of("cpu", parts)
    names = "/".join(sorted({t.name for t in kinds}))
    assert layer.method.name == f"gguf {names} (per expert, C)"
    dense = [torch.cat([GGUFTensor("", p.type_name, p.raw[e], K).dense() for p in parts]) for e in range(E)]
    for e in range(E):
        assert torch.equal(layer.method.dequantize(layer, e), dense[e])
    if kinds == (T.MXFP4,):  # the file's bytes as they are: views of the stack, no copy
        assert layer.method.nbytes(layer) == parts[0].raw.numel()
        assert layer.gguf_experts[1][0].data.data_ptr() == parts[0].raw[1].data_ptr()
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(3))
    counts = [4, 0, 5]
    y = layer(x, counts)
    want = torch.cat([x[:4] @ dense[0].T, x[4:] @ dense[2].T])
    assert ((y - want).norm() / want.norm()).item() < 3e-2  # the kernels' int8 inputs
    # a row's result does not depend on the rows beside it (what the deterministic mode needs of a kernel)
    alone = layer(x[5:6], [0, 0, 1])
    assert torch.equal(alone[0], y[5])
    bf = layer(x.bfloat16(), counts)
    assert bf.dtype == torch.bfloat16 and ((bf.float() - want).norm() / want.norm()).item() < 3e-2


def test_the_torch_ops_keep_their_reference():
    gen = np.random.default_rng(8)
    parts = [stack("ffn_up_exps", T.MXFP4, ROWS, gen)]
    layer = layer_of("torch", parts)
    assert "per expert" not in layer.method.name
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4))
    want = x @ GGUFTensor("", "MXFP4", parts[0].raw[1], K).dense().T
    assert torch.allclose(layer(x, [0, 2, 0]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
@pytest.mark.parametrize("kind", C_DENSE)
def test_c_row_readers_dequantize_as_the_gguf_package(kind):
    gen = np.random.default_rng(9)
    raw = blocks(T[kind], 5, K, gen)
    t = GGUFTensor("w", kind, torch.from_numpy(raw), K)
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).copy()).float().reshape(5, K)
    assert torch.equal(t.dense(), want)
