"""Grouped experts (layers/quantization/experts.py): E experts in one layer and one layout, tokens grouped by expert,
against one plain matmul per token with its expert's weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixgen.runtime.layers.quantization.base import QuantizedWeight
from radixgen.runtime.layers.quantization.experts import GroupedLinear, group_by_expert, grouped_method

E, K, N = 5, 32, 24


def experts_layer(method: str, dtype: torch.dtype, weights: torch.Tensor) -> GroupedLinear:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = GroupedLinear(E, K, N, grouped_method(method))
    finally:
        torch.set_default_dtype(default)
    for e in range(E):
        layer.weight.weight_loader(layer.weight, weights[e], e)
    layer.process_weights()
    return layer


@pytest.mark.parametrize("method", ["none", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_forward_equals_per_expert_matmuls(method, dtype):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(E, N, K, generator=gen)
    layer = experts_layer(method, dtype, weights.to(dtype))
    if method == "int8":
        assert layer.weight is None and layer.q.dtype == torch.int8 and layer.q.shape == (E, N, K)
    t, top_k = 13, 2
    x = torch.randn(t, K, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(t)])  # (T, top_k), expert 4 idle
    ids[ids == 4] = 3
    order, counts = group_by_expert(ids, E)
    assert counts[4] == 0 and sum(counts) == t * top_k
    rows = order // top_k  # each grouped row's token
    got = layer(x[rows], counts)  # (T * top_k, N), grouped
    flat = ids.reshape(-1)[order]
    assert torch.equal(flat, flat.sort().values)  # grouped, experts in order
    for i in range(t * top_k):
        e = int(flat[i])
        w = weights[e].to(dtype) if method == "none" else QuantizedWeight.int8_from(weights[e].to(dtype)).dequantize()
        want = F.linear(x[rows[i]].float(), w.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got[i].float(), want, rtol=tol, atol=tol * want.abs().max().item()), (i, e)
        assert torch.allclose(layer.method.dequantize(layer, e), w.float())


def test_grouped_errors_name_the_problem():
    layer = GroupedLinear(E, K, N)
    with pytest.raises(ValueError, match="expert 5 is outside"):
        layer.weight.weight_loader(layer.weight, torch.zeros(N, K), 5)
    with pytest.raises(ValueError, match=r"expected \(24, 32\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(K, N), 0)
    with pytest.raises(ValueError, match="counts"):
        layer(torch.zeros(3, K), [1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="expert ids"):
        group_by_expert(torch.tensor([0, 7]), E)
    with pytest.raises(ValueError, match="'gptq' has no grouped-expert form"):
        grouped_method("gptq")
