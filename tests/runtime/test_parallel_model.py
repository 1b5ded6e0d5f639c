"""Tensor and pipeline parallel groups (spawned processes, gloo, one thread per rank) against one process on the
same weights and the same steps (parallel_helpers.drive: extends with and without a cached prefix, decodes):

- float32: the logits of tp 2, pp 2 and tp 2 x pp 2 equal tp 1's within float32 rounding, on tiny Llama, Qwen2
  and Qwen3 models, a model with fewer KV heads than ranks (llama-hd64: one), a tied one, and one that tp 2
  splits unevenly (3 KV heads, 129 MLP columns, an odd vocabulary padded to equal shards);
- over an 8-bit KV cache (each rank quantizes its KV heads' rows, as one process does): tp 2 within float32
  rounding of tp 1, pp 2 bit for bit;
- bfloat16, the fused decode step per rank (its all-reduces inside the C call): tp 2's fused step gives the
  same bits as tp 2's unfused path, and pipeline stages change no rounding at all (pp 2 == tp 1, bit for bit);
- quantized weights sharded in their own layouts (an AWQ int4 checkpoint): tp 2 within float32 rounding of one
  process, and the bf16 fused step per rank over the int4 layouts.
"""

from __future__ import annotations

import pytest
import torch
from parallel_helpers import run_group, run_single
from quant_checkpoints import write_awq
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu

TOL = 1e-5


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-hd64", "llama-tied", "llama-odd"])
def test_tp2_logits_equal_tp1(arch):
    path = str(tiny_model_dir(arch))
    want = run_single(path, dtype="float32")["logits"]
    got = run_group(path, dtype="float32", tp_size=2)["logits"]
    assert got.shape == want.shape
    assert rel_max(got, want) < TOL


@pytest.mark.parametrize("layout", [{"pp_size": 2}, {"tp_size": 2, "pp_size": 2}])
def test_pipeline_stages_logits_equal_tp1(layout):
    path = str(tiny_model_dir("llama-odd"))
    want = run_single(path, dtype="float32")["logits"]
    got = run_group(path, dtype="float32", **layout)["logits"]
    assert rel_max(got, want) < TOL


def test_parallel_groups_over_an_8bit_kv_cache():
    path = str(tiny_model_dir("llama-odd"))
    want = run_single(path, dtype="float32", kv_cache_dtype="int8")["logits"]
    assert rel_max(run_group(path, dtype="float32", kv_cache_dtype="int8", tp_size=2)["logits"], want) < TOL
    assert torch.equal(run_group(path, dtype="float32", kv_cache_dtype="int8", pp_size=2)["logits"], want)


needs_fused = pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step),
                                 reason="the fused decode step needs the CPU kernels built with AVX512-BF16")


@needs_fused
@pytest.mark.parametrize("arch", ["qwen3", "llama-hd64"])
def test_fused_step_per_rank(arch):
    path = str(tiny_model_dir(arch))
    fused = run_group(path, dtype="bfloat16", tp_size=2)
    plain = run_group(path, dtype="bfloat16", tp_size=2, fused=False)
    single = run_single(path, dtype="bfloat16")
    assert fused["fused"] and not plain["fused"] and single["fused"]
    assert torch.equal(fused["logits"], plain["logits"])
    # against one process: bf16 partial sums reduced in bf16, as close as the fused step is to the unfused one
    assert ((fused["logits"] - single["logits"]).norm() / single["logits"].norm()).item() < 2e-2
    staged = run_group(path, dtype="bfloat16", pp_size=2)
    assert staged["fused"] and torch.equal(staged["logits"], single["logits"])


def test_tp2_over_int4_weights(tmp_path):
    """Column-parallel layers take their packed output columns of qweight / qzeros / scales, row-parallel ones whole
    groups of input rows: the same dequantized weights as one process, so the same logits within float32
    rounding; in bf16 every rank's fused step reads its int4 shards."""
    path = str(write_awq(tmp_path / "awq", group=32)[0])
    want = run_single(path, dtype="float32", quantization="awq")["logits"]
    assert rel_max(run_group(path, dtype="float32", tp_size=2)["logits"], want) < TOL
    if cpu.available() and cpu.lib().has_decode_step:
        fused, single = run_group(path, dtype="bfloat16", tp_size=2), run_single(path, dtype="bfloat16")
        assert fused["fused"] and single["fused"]
        assert ((fused["logits"] - single["logits"]).norm() / single["logits"].norm()).item() < 2e-2
