"""LoRA deltas in the forward pass, against PEFT: batches mixing several adapters and the base model, on each
path (C kernels with oneDNN-packed weights, plain torch, the fused bf16 decode step, the Triton wiring under
the interpreter). The adapters are random PEFT adapters on the tiny models; radixgen's logits of every row
equal the PEFT model's of that row's adapter (or the base model's)."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_of
from lora_helpers import ALL, base_model, make_adapter
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu, cpu_fused
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor import cpu_decode
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.lora import LoRAAdapterError, load_lora_adapter
from radixgen.runtime.lora.pool import LoRABatch

# two adapters per architecture: every projection (rank 4), and q/v/down only with rsLoRA (rank 8)
ADAPTERS = {"a": dict(rank=4, targets=ALL, seed=1), "b": dict(rank=8, targets=("q_proj", "v_proj", "down_proj"),
                                                               seed=2, use_rslora=True)}
SLOTS = {"a": 2, "b": 0}  # not in load order: the slot index, not the adapter's position, must select it


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama-hd64"])
def arch_adapters(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    models = {name: make_adapter(arch, root / name, **kw) for name, kw in ADAPTERS.items()}
    return arch, root, models


def runner_for(arch, root, dtype="float32", **kw) -> ModelRunner:
    cfg = RuntimeConfig(model=str(tiny_model_dir(arch)), dtype=dtype, max_total_tokens=4096, max_running_requests=24,
                        enable_lora=True, max_loras=3, max_lora_rank=8, **kw)
    r = ModelRunner(cfg)
    for name, slot in SLOTS.items():
        r.lora_pool.write(slot, r.lora_pool.stage(load_lora_adapter(name, root / name)))
    return r


def steps(runner: ModelRunner, prompts: list[list[int]], adapters: list[str | None], forced: list[list[int]],
          logits_of_all: bool = True) -> list[torch.Tensor]:
    """A prefill of every prompt in one batch, then one decode step per list of `forced` (one token per request);
    the logits of each step (every prefill row, or the last ones)."""
    kv = kv_of(runner)
    rows = [kv.table.allocate() for _ in prompts]
    lens = [len(p) for p in prompts]
    slots_of = [-1 if a is None else SLOTS[a] for a in adapters]
    slots = [kv.allocator.allocate(n) for n in lens]
    for row, s in zip(rows, slots, strict=True):
        kv.table.write(row, 0, s)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    logit_rows = torch.arange(sum(lens)) if logits_of_all else torch.tensor(lens).cumsum(0) - 1
    out = [runner.forward(ForwardInput(ids, pos, torch.cat(slots), torch.tensor(rows), [0] * len(lens), lens,
                                       logit_rows, lora_slots=slots_of))]
    for tokens in forced:
        s = kv.allocator.allocate(len(rows))
        for i, row in enumerate(rows):
            kv.table.write(row, lens[i], s[i:i + 1])
        out.append(runner.forward(ForwardInput(torch.tensor(tokens), torch.tensor(lens), s, torch.tensor(rows),
                                               list(lens), [1] * len(rows), torch.arange(len(rows)),
                                               lora_slots=slots_of)))
        lens = [n + 1 for n in lens]
    for row in rows:
        kv.table.free(row)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def reference(models: dict, arch: str, seq: list[int], adapter: str | None) -> torch.Tensor:
    model = base_model(arch) if adapter is None else models[adapter]
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


PROMPTS = [[5, 9, 13, 17, 21, 400, 7], [11, 12, 13], [31, 32, 33, 34, 35], [40, 41, 42, 43]]
USES = ["a", None, "b", "a"]  # two requests of one adapter, apart in the batch
FORCED = [[101, 102, 103, 104], [201, 202, 203, 204], [301, 302, 303, 304]]


@pytest.mark.parametrize("path", ["c", "torch"])
def test_mixed_batch_logits_equal_peft(arch_adapters, path):
    arch, root, models = arch_adapters
    runner = runner_for(arch, root, disable_cpu_kernels=path == "torch")
    out = steps(runner, PROMPTS, USES, FORCED)
    starts = torch.tensor([0] + [len(p) for p in PROMPTS]).cumsum(0)
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, USES, strict=True)):
        seq = prompt + [f[i] for f in FORCED]
        want = reference(models, arch, seq, adapter)
        got = torch.cat([out[0][starts[i]:starts[i + 1]], *(o[i:i + 1] for o in out[1:])])
        assert rel(got, want) < 1e-4, (i, adapter)
        if adapter is not None:  # the adapter changes the logits well beyond the tolerance
            assert rel(want, reference(models, arch, seq, None)) > 0.05


@pytest.mark.parametrize("path", ["c", "torch"])
def test_mixed_batch_equals_each_request_alone(arch_adapters, path):
    arch, root, _ = arch_adapters
    runner = runner_for(arch, root, disable_cpu_kernels=path == "torch")
    together = steps(runner, PROMPTS, USES, FORCED, logits_of_all=False)
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, USES, strict=True)):
        alone = steps(runner, [prompt], [adapter], [[f[i]] for f in FORCED], logits_of_all=False)
        for a, b in zip(alone, together, strict=True):
            assert rel(a[0], b[i]) < 1e-5, (i, adapter)


@pytest.mark.parametrize("quant", ["none", "int8"])  # int8: the deltas after matmuls over int8 weights
def test_fused_decode_with_adapter_rows_equals_unfused(arch_adapters, quant):
    """bf16: the fused C step adds the LoRA deltas after each of its matmuls, whatever the base weights' layout;
    its logits are the unfused path's (the C segmented kernel), and it really ran, with the adapters' effect."""
    if not (cpu.available() and cpu.lib().has_decode_step):
        pytest.skip("the fused decode step needs the CPU kernels built with AVX512-BF16")
    arch, root, _ = arch_adapters
    fused, plain = (runner_for(arch, root, dtype="bfloat16", quantization=quant) for _ in range(2))
    plain.fused_decode = None
    assert fused.fused_decode is not None and fused.fused_decode.lora is not None
    gen = torch.Generator().manual_seed(3)
    for batch in (1, 6, 21):  # 21: rows through the kernel in blocks of 8, 4 and 1
        prompts = [torch.randint(3, 49152, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 30, (batch,), generator=gen)]
        uses = [("a", "b", None)[(i + batch) % 3] for i in range(batch)]
        forced = [torch.randint(3, 49152, (batch,), generator=gen).tolist() for _ in range(4)]
        calls = []
        real = cpu_fused.decode_step
        cpu_decode.cpu_fused.decode_step = lambda *a, _c=calls, _r=real, **kw: _c.append(1) or _r(*a, **kw)
        try:
            got = torch.stack(steps(fused, prompts, uses, forced, logits_of_all=False)[1:])
        finally:
            cpu_decode.cpu_fused.decode_step = real
        want = torch.stack(steps(plain, prompts, uses, forced, logits_of_all=False)[1:])
        base = torch.stack(steps(plain, prompts, [None] * batch, forced, logits_of_all=False)[1:])
        assert len(calls) == 4
        # over int8 the unfused GEMM rounds each dequantized tile to bf16, the fused step's gemv does not
        assert ((got - want).norm() / want.norm()).item() < (1e-2 if quant == "none" else 2e-2), batch
        lora_rows = [i for i, u in enumerate(uses) if u is not None]
        if lora_rows:
            assert ((base[:, lora_rows] - want[:, lora_rows]).norm() / want[:, lora_rows].norm()).item() > 0.05


@pytest.mark.parametrize("arch_adapters", ["llama-hd64"], indirect=True)  # head_dim 64: the C extend kernel
def test_kept_rows_with_adapters_are_bit_exact(arch_adapters):
    """bf16 on the C extend kernel: a step whose logits are wanted at a few rows computes the last layer (LoRA
    deltas included) for those rows alone, and gets the bits of the full computation."""
    arch, root, _ = arch_adapters
    if not cpu.extend_attention_supported(cpu.lib(), torch.bfloat16, 64):
        pytest.skip("the rows-only last layer needs the bf16 C extend kernel (AVX512-BF16)")
    runner = runner_for(arch, root, dtype="bfloat16")
    lens = [9, 14, 6]
    ids = torch.randint(3, 49152, (sum(lens),), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lens])
    uses = [SLOTS["a"], -1, SLOTS["b"]]

    def run(logit_rows):
        kv = kv_of(runner)
        rows = [kv.table.allocate() for _ in lens]
        slots = [kv.allocator.allocate(n) for n in lens]
        for row, s in zip(rows, slots, strict=True):
            kv.table.write(row, 0, s)
        out = runner.forward(ForwardInput(ids, pos, torch.cat(slots), torch.tensor(rows), [0] * 3, lens,
                                          torch.tensor(logit_rows), lora_slots=uses))
        for row in rows:
            kv.table.free(row)
        return out

    keep = [8, 3, 22, 28]
    seen = []
    real = LoRABatch.rows_for
    LoRABatch.rows_for = lambda self, n, k: seen.append(n) or real(self, n, k)
    try:
        kept = run(keep)
    finally:
        LoRABatch.rows_for = real
    assert torch.equal(kept, run(list(range(sum(lens))))[keep])
    assert len(keep) in seen  # the last layer's o_proj / MLP ran on the kept rows, with their adapters


def test_pool_refuses_what_it_cannot_hold(tmp_path):
    make_adapter("llama", tmp_path / "r16", rank=16, seed=3)
    make_adapter("llama", tmp_path / "up", rank=4, targets=("up_proj",), seed=4)
    cfg = RuntimeConfig(model=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=512,
                        max_running_requests=2, enable_lora=True, max_loras=2, max_lora_rank=8,
                        lora_target_modules=("q_proj", "v_proj"))
    pool = ModelRunner(cfg).lora_pool
    assert pool.groups == ["qkv_proj"] and pool.rank == 8
    with pytest.raises(LoRAAdapterError, match="rank 16 exceeds max_lora_rank 8"):
        load_lora_adapter("r16", tmp_path / "r16", max_lora_rank=pool.max_rank)
    with pytest.raises(LoRAAdapterError, match=r"target modules \['up_proj'\] are not among"):
        pool.stage(load_lora_adapter("up", tmp_path / "up"))
