"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q / k / v bias: the config's qkv_bias) and expert
blocks with a shared expert: softmax over the experts, top-k (renormalised with norm_topk_prob), plus
sigmoid(shared_expert_gate(x)) * shared_expert(x); decoder_sparse_step / mlp_only_layers as Qwen3-MoE's."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.moe_block import moe_mlp
from radixgen.runtime.models.parts import AttentionSpec
from radixgen.runtime.models.weights import (
    ATTENTION_WEIGHTS,
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    QKV_BIAS_WEIGHTS,
    QWEN_MOE_WEIGHTS,
    SHARED_EXPERT_WEIGHTS,
)

# the bias comes from ModelConfig.attention_bias (config.json qkv_bias, true by default)
QWEN2_MOE = Architecture(
    "qwen2_moe", AttentionSpec(), mlp=moe_mlp,
    weights=(DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + QWEN_MOE_WEIGHTS + SHARED_EXPERT_WEIGHTS
             + GATED_MLP_WEIGHTS),
    gguf_arch="qwen2moe")


class Qwen2MoeForCausalLM(CausalLM):
    architecture = QWEN2_MOE
