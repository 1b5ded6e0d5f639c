"""The quantization package: what a request resolves to against a checkpoint's config (and the errors where they
do not match), each quantized linear method against its dequantized reference on every ops set that runs on
the CPU (C kernels, plain torch), the loaders taking a rank's shard of quantized tensors (packed along one dim,
grouped along another), and one copy of every weight in a loaded model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_checkpoints import AWQ_NIBBLE_COLUMN, pack_along_cols, pack_along_rows
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.ground.parallel_context import ParallelAxis
from radixgen.runtime.layers import quantization
from radixgen.runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixgen.runtime.layers.ops import CpuOps, TorchOps
from radixgen.runtime.layers.quantization import QuantSpec, resolve
from radixgen.runtime.layers.quantization.base import QuantizedWeight

OPS = {"c": lambda: CpuOps(cpu.lib()), "torch": TorchOps}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_resolve_against_the_checkpoint():
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                   "version": "gemm"}}
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True}}
    assert resolve("auto", {}) == QuantSpec("none")
    assert resolve("auto", awq) == QuantSpec("awq", group_size=128)
    assert resolve("awq", awq) == QuantSpec("awq", group_size=128)
    assert resolve("auto", gptq) == QuantSpec("gptq", group_size=0, zero_offset=1)  # v1: zeros stored minus one
    v2 = {"quantization_config": {**gptq["quantization_config"], "checkpoint_format": "gptq_v2"}}
    assert resolve("auto", v2).zero_offset == 0
    assert resolve("int8", {}) == QuantSpec("int8", from_float=True)
    assert resolve("fp8", {}) == QuantSpec("fp8", from_float=True)
    assert resolve("auto", {"quantization_config": {"quant_method": "fp8"}}) == QuantSpec("fp8")
    assert resolve("auto", {}, gguf_native=True) == resolve("gguf", {}, gguf_native=True) == QuantSpec("gguf")
    bad = [("none", awq, "needs an unquantized checkpoint, but the checkpoint is quantized with awq"),
           ("int8", gptq, "needs a float checkpoint, but the checkpoint is quantized with gptq"),
           ("gptq", awq, "needs a GPTQ checkpoint"), ("awq", {}, "needs an AWQ checkpoint"),
           ("gguf", {}, "needs a .gguf file"), ("int8", {}, None),
           ("auto", {"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
           ("auto", {"quantization_config": {**awq["quantization_config"], "version": "gemv"}}, "version 'gemv'"),
           ("auto", {"quantization_config": {**awq["quantization_config"], "bits": 3}}, "3 bits"),
           ("auto", {"quantization_config": {**gptq["quantization_config"], "group_size": 0}}, "group_size"),
           ("auto", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "block-wise"),
           ("auto", {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "weight-only"),
           ("auto", {"quantization_config": {**awq["quantization_config"], "modules_to_not_convert": ["q_proj"]}},
            "only the LM head")]
    for requested, hf, message in bad:
        if message is None:
            continue
        with pytest.raises(ValueError, match=message):
            resolve(requested, hf)


def layer_with(kind, ops_name: str, spec: QuantSpec, dtype=torch.float32, **kw):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = kind(**kw)
        ops = OPS[ops_name]()
        layer.set_linear_method(quantization.linear_method(ops.name, spec, layer, ops.kernels))
    finally:
        torch.set_default_dtype(default)
    return layer


@pytest.mark.parametrize("ops_name", list(OPS))
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_float_methods_against_their_dequantized_reference(ops_name, method, dtype):
    """int8 and fp8 quantized at load from a merged layer's float parts: the layer computes with its dequantized
    weight (which stays close to the float one), and its output is that weight's."""
    if ops_name == "c" and not cpu.available():
        pytest.skip("no C kernels")
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(48, 64, generator=gen) for _ in range(2)]
    layer = layer_with(MergedColumnParallelLinear, ops_name, QuantSpec(method, from_float=True), dtype,
                       in_features=64, out_sizes=[48, 48])
    for i, p in enumerate(parts):
        layer.weight.weight_loader(layer.weight, p, i)
    layer.process_weights()
    assert layer.weight is None
    w = torch.cat(parts)
    deq = layer.method.dequantize(layer)
    assert rel(deq, w) < (1e-2 if method == "int8" else 4e-2)  # int8: steps of max/127 per row; e4m3: 3 bits
    if method == "int8":
        assert torch.equal(deq, QuantizedWeight.int8_from(w.to(dtype)).dequantize())
    for m in (1, 7, 30):
        x = torch.randn(m, 64, generator=gen).to(dtype)
        want = F.linear(x.float(), deq).to(dtype)
        assert rel(layer(x), want) < (1e-5 if dtype == torch.float32 else 1e-2), m


def awq_tensors(q, z, s):
    """(out, in) values, (out, in / g) zeros and scales -> AWQ's qweight, qzeros, scales."""
    return (pack_along_cols(q.t().contiguous(), AWQ_NIBBLE_COLUMN), pack_along_cols(z.t().contiguous(),
            AWQ_NIBBLE_COLUMN), s.t().contiguous().half())


@pytest.mark.parametrize("ops_name", list(OPS))
def test_awq_and_gptq_layers_take_their_rank_shard(ops_name):
    """With tensor parallelism (rank 1 of 2), a column-parallel AWQ layer takes its half of the output columns of
    every packed tensor, a row-parallel GPTQ layer its half of the input rows (whole groups), and each computes
    with exactly that shard of the dequantized weight."""
    if ops_name == "c" and not cpu.available():
        pytest.skip("no C kernels")
    tp = ParallelAxis.shard("tp", 1, 2)  # rank 1's shard, built in this process
    gen = torch.Generator().manual_seed(4)
    n, k, g = 64, 128, 32
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (n, k // g), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.1).half().float()  # fp16 exactly, as stored
    dense = s.repeat_interleave(g, 1) * (q - z.repeat_interleave(g, 1)).float()  # (out, in)

    col = layer_with(ColumnParallelLinear, ops_name, QuantSpec("awq", group_size=g), in_features=k, out_features=n,
                     tp=tp)
    for name, t in zip(("qweight", "qzeros", "scales"), awq_tensors(q, z, s), strict=True):
        getattr(col, name).weight_loader(getattr(col, name), t, None)
    col.process_weights()
    assert torch.allclose(col.method.dequantize(col), dense[n // 2:], rtol=1e-6)

    row = layer_with(RowParallelLinear, ops_name, QuantSpec("gptq", group_size=g, zero_offset=0), in_features=k,
                     out_features=n, tp=tp)
    tensors = {"qweight": pack_along_rows(q.t().contiguous()), "qzeros": pack_along_cols(z.t().contiguous()),
               "scales": s.t().contiguous().half(), "g_idx": (torch.arange(k) // g).int()}
    for name, t in tensors.items():
        getattr(row, name).weight_loader(getattr(row, name), t, None)
    row.process_weights()
    assert torch.allclose(row.method.dequantize(row), dense[:, k // 2:], rtol=1e-6)


def test_splits_the_quantized_layouts_cannot_take():
    """Under tp 2, where a rank's share does not fall on the format's bounds, startup fails naming the
    combination: GPTQ's activation order (a row-parallel rank's columns in other ranks' groups), groups cut by
    the split, GGUF blocks cut by it."""
    from radixgen.runtime.layers.quantization.gguf import GGUFTensor

    tp = ParallelAxis.shard("tp", 0, 2)
    n, k, g = 32, 128, 32
    row = layer_with(RowParallelLinear, "torch", QuantSpec("gptq", group_size=g), in_features=k, out_features=n,
                     tp=tp)
    tensors = {"qweight": torch.zeros(k // 8, n, dtype=torch.int32), "qzeros": torch.zeros(k // g, n // 8).int(),
               "scales": torch.ones(k // g, n).half(), "g_idx": (torch.randperm(k) // g).int()}  # desc_act
    for name, t in tensors.items():
        getattr(row, name).weight_loader(getattr(row, name), t, None)
    with pytest.raises(ValueError, match=r"activation order.*tp_size=2"):
        row.process_weights()
    with pytest.raises(ValueError, match=r"group size 32.*tp_size=2"):  # 48 input columns a rank
        layer_with(RowParallelLinear, "torch", QuantSpec("awq", group_size=g), in_features=96, out_features=n, tp=tp)
    q4 = GGUFTensor("blk.0.ffn_down.weight", "Q4_0", torch.zeros(n, 2 * 18, dtype=torch.uint8), 64)  # 2 blocks
    assert q4.narrow(1, 32, 32).raw.shape == (n, 18)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' \(Q4_0\).*blocks of 32"):
        q4.narrow(1, 16, 32)


def test_merged_gptq_parts_must_share_g_idx():
    layer = layer_with(QKVParallelLinear, "torch", QuantSpec("gptq", group_size=32), hidden=64, head_dim=16,
                       num_heads=2, num_kv_heads=1, bias=False)
    layer.g_idx.weight_loader(layer.g_idx, torch.arange(64).int() // 32, "q")
    with pytest.raises(ValueError, match="differ"):
        layer.g_idx.weight_loader(layer.g_idx, torch.randperm(64).int() // 32, "k")


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
@pytest.mark.parametrize("q", ["none", "int8"])
def test_one_copy_of_every_weight(q):
    """A loaded bf16 model holds each weight once, in its kernel's layout: no dense weight beside a packed one, the
    tied embedding reading the LM head's, and the weights' bytes those of the layouts."""
    r = ModelRunner(RuntimeConfig(model=str(tiny_model_dir("llama-tied")), dtype="bfloat16", max_total_tokens=256,
                                  max_running_requests=2, quantization=q))
    m = r.model
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    packed = sum(layer.packed.nbytes for layer in m.modules() if getattr(layer, "packed", None) is not None)
    assert quantization.weight_bytes(m) == params + packed
    cfg = r.model_config
    per_weight = 1 if q == "int8" else 2
    head = cfg.vocab_size * cfg.hidden_size * per_weight
    assert packed >= head and params < 0.01 * packed  # norms only besides the layouts
    assert m.embed_tokens.weight is None and m.lm_head.weight is None
