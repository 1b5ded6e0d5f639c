"""The GPU path's wiring, checked on the CPU under the Triton interpreter: a ModelRunner switched to the
Triton kernels (attention, fused add-RMSNorm, rotary, as on CUDA) gives the logits of the default CPU runner
on the same weights, over a prefill of unequal prompts and decode steps."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import rel_err
from kv_helpers import kv_of
from quant_checkpoints import write_awq, write_fp8, write_gptq
from tiny_models import tiny_model_dir

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.layers.ops import TritonOps


def run_steps(runner: ModelRunner, prompts: list[list[int]], decode_steps: int) -> list[torch.Tensor]:
    """Prefill all prompts in one extend batch, then greedy decode steps; the logits of every step."""
    rows = [kv_of(runner).table.allocate() for _ in prompts]
    lens = [len(p) for p in prompts]
    slots = []
    for row, n in zip(rows, lens, strict=True):
        s = kv_of(runner).allocator.allocate(n)
        kv_of(runner).table.write(row, 0, s)
        slots.append(s)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    last = torch.tensor(lens).cumsum(0) - 1
    out = [runner.forward(ForwardInput(ids, pos, torch.cat(slots), torch.tensor(rows), [0] * len(lens), lens,
                                       last))]
    for _ in range(decode_steps):
        nxt = out[-1].argmax(-1)
        s = kv_of(runner).allocator.allocate(len(rows))
        for i, row in enumerate(rows):
            kv_of(runner).table.write(row, lens[i], s[i:i + 1])
        out.append(runner.forward(ForwardInput(nxt, torch.tensor(lens), s, torch.tensor(rows), list(lens),
                                               [1] * len(rows), torch.arange(len(rows)))))
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_wired_runner_matches_cpu_runner(arch, triton):
    folder = tiny_model_dir(arch)
    cfg = RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=512, max_running_requests=4)
    cpu_runner, triton_runner = ModelRunner(cfg), ModelRunner(cfg, ops=TritonOps())
    layer = triton_runner.model.layers[0]
    assert layer.input_layernorm.ops is triton_runner.ops and layer.self_attn.rotary.ops is triton_runner.ops
    assert layer.mlp.act.ops is triton_runner.ops and triton_runner.fused_decode is None
    assert layer.mlp.down_proj.packed is None and layer.mlp.down_proj.weight is not None  # dense, as on CUDA
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    ours, ref = run_steps(triton_runner, prompts, 3), run_steps(cpu_runner, prompts, 3)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert rel_err(a, b) < 1e-4, step


QUANTIZED = {  # name -> (checkpoint writer or None for a float checkpoint, quantization, the Triton method's name)
    "awq": (write_awq, "auto", "awq (triton)"),
    "gptq-act-order": (lambda out: write_gptq(out, act_order=True), "auto", "gptq (triton)"),
    "int8": (None, "int8", "int8 (triton)"),
    "fp8": (write_fp8, "auto", "fp8 (triton)"),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_triton_quantized_linears_match_cpu_runner(name, triton, tmp_path):
    """The dequantizing Triton matmuls wired through TritonOps' linear methods: a quantized checkpoint (or int8
    from a float one) on the Triton ops against the CPU runner of the same checkpoint."""
    writer, quantization, method = QUANTIZED[name]
    folder = tiny_model_dir("llama") if writer is None else writer(tmp_path / name)[0]
    cfg = RuntimeConfig(model=str(folder), dtype="float32", max_total_tokens=512, max_running_requests=4,
                        quantization=quantization)
    cpu_runner, triton_runner = ModelRunner(cfg), ModelRunner(cfg, ops=TritonOps())
    assert method in triton_runner.ops.linear_methods(triton_runner.model)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 9)]
    for step, (a, b) in enumerate(zip(run_steps(triton_runner, prompts, 2), run_steps(cpu_runner, prompts, 2),
                                      strict=True)):
        assert rel_err(a, b) < 1e-4, step


def test_gguf_quantization_is_refused_on_triton(triton):
    with pytest.raises(ValueError, match="gguf runs on the CPU"):
        ModelRunner(RuntimeConfig(dtype="float32", max_total_tokens=512, max_running_requests=4,
                                  quantization="gguf"), ops=TritonOps())
