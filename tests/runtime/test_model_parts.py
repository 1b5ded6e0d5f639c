"""Models declared from parts (models/decoder.py, parts.py, weights.py): the declared weight mappings, and a
test-local architecture whose MLP slot holds an expert block, which the fused CPU decode step and the CUDA graph
runner refuse by what its layers say of themselves (the steps then run layer by layer)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model_dir

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor import model_runner as model_runner_module
from radixgen.runtime.executor.cpu_decode import FusedDecode
from radixgen.runtime.executor.cuda_graph_runner import CudaGraphRunner, graph_unsafe
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner
from radixgen.runtime.models import for_gguf, model_class
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP, MLPPart, MLPStructure
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS


class ToyExperts(MLPPart):
    """Two dense experts, each token sent to the one its router scores higher (an expert block's shape)."""

    def __init__(self, cfg, par, layer_id):
        super().__init__()
        self.router = torch.nn.Parameter(torch.empty(2, cfg.hidden_size), requires_grad=False)
        self.experts = torch.nn.ModuleList([GatedMLP(cfg, par, layer_id) for _ in range(2)])

    def forward(self, x):
        pick = (x.float() @ self.router.float().t()).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (pick == e).nonzero().squeeze(-1)
            if rows.numel():
                out[rows] = expert(x[rows])
        return out

    def structure(self):
        return MLPStructure("toy_experts", {}, self.experts[0].down_proj.in_features, graph_safe=False)


class ToyMoE(CausalLM):
    architecture = Architecture("toy_moe", AttentionSpec(), DECODER_WEIGHTS + ATTENTION_WEIGHTS, mlp=ToyExperts)


def runner_of(cls, monkeypatch, dtype="bfloat16") -> ModelRunner:
    monkeypatch.setattr(model_runner_module, "model_class", lambda arch: cls)
    cfg = RuntimeConfig(model=str(tiny_model_dir("llama")), dtype=dtype, load_format="dummy", max_total_tokens=256,
                        max_running_requests=4)
    return ModelRunner(cfg)


def test_declared_mappings():
    llama, qwen3 = model_class("llama").architecture.weights, model_class("qwen3").architecture.weights
    assert llama.parameter("layers.3.self_attn.k_proj.weight") == ("layers.3.self_attn.qkv_proj.weight", "k")
    assert llama.parameter("layers.0.mlp.up_proj.weight") == ("layers.0.mlp.gate_up_proj.weight", 1)
    assert llama.parameter("norm.weight") == ("norm.weight", None)
    assert llama.hf_name("blk.2.ffn_down.weight") == "model.layers.2.mlp.down_proj.weight"
    assert llama.hf_name("token_embd.weight") == "model.embed_tokens.weight" and llama.hf_name("rope_freqs") is None
    assert qwen3.hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert llama.hf_name("blk.1.attn_k_norm.weight") is None  # Llama declares no q/k norms
    assert llama.gguf_rope_permuted and not qwen3.gguf_rope_permuted
    assert llama.is_gguf_matmul("blk.0.attn_q.weight") and not llama.is_gguf_matmul("blk.0.attn_norm.weight")
    assert for_gguf("qwen2")[0] == "Qwen2ForCausalLM" and for_gguf("qwen2")[1].attention.qkv_bias
    assert for_gguf("gpt2") is None


def test_an_expert_block_sends_steps_to_the_layer_by_layer_path(monkeypatch):
    runner = runner_of(ToyMoE, monkeypatch)
    layers = runner.model.decoder_structure()
    assert [layer.mlp.kind for layer in layers] == ["toy_experts"] * len(layers)
    assert "MLP part is 'toy_experts'" in FusedDecode.supports(layers, 256)
    assert runner.fused_decode is None
    assert "'toy_experts' is not graph-safe" in graph_unsafe(runner.model)
    with pytest.raises(ValueError, match="CUDA graphs cannot capture.*toy_experts.*disable_cuda_graph"):
        CudaGraphRunner(runner, capture=False)
    # the dense declaration on the same config: the fused step takes it (where the C kernels have one)
    dense = runner_of(model_class("llama"), monkeypatch)
    assert FusedDecode.supports(dense.model.decoder_structure(), 256) is None and graph_unsafe(dense.model) is None
    if cpu.available() and cpu.lib().has_decode_step:
        assert dense.fused_decode is not None
    # a prefill and a decode step run layer by layer, and the decode step's logits are the prefill's of the same
    # tokens (the expert picked per token either way)
    slots = runner_kv_slots(runner, 5)
    ids = torch.tensor([3, 9, 4, 1, 7])
    full = runner.forward(ForwardInput(ids, torch.arange(5), slots, torch.tensor([0]), [0], [5], torch.arange(5)))
    prefix = runner_kv_slots(runner, 5, row=1)
    runner.forward(ForwardInput(ids[:4], torch.arange(4), prefix[:4], torch.tensor([1]), [0], [4], torch.tensor([3])))
    step = runner.forward(ForwardInput(ids[4:], torch.tensor([4]), prefix[4:], torch.tensor([1]), [4], [1],
                                       torch.tensor([0])))
    assert step.shape == (1, runner.vocab_size) and torch.isfinite(step).all()
    assert torch.allclose(step[0], full[4], atol=5e-2 * full[4].abs().max().item())


def runner_kv_slots(runner: ModelRunner, n: int, row: int = 0) -> torch.Tensor:
    """n fresh slots written into request row `row` of the runner's table."""
    slots = torch.arange(1 + 8 * row, 1 + 8 * row + n)
    runner.req_to_slot[row, :n] = slots.to(runner.req_to_slot.dtype)
    return slots
