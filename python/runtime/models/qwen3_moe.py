"""Qwen3-MoE: Qwen3's attention (q / k RMSNorm per head, no bias) and expert blocks (softmax over the experts,
top-k, renormalised when the config's norm_topk_prob says so; no shared expert); decoder_sparse_step and
mlp_only_layers give some layers the dense MLP instead."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.moe_block import moe_mlp
from radixgen.runtime.models.parts import AttentionSpec
from radixgen.runtime.models.weights import (
    ATTENTION_WEIGHTS,
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    QK_NORM_WEIGHTS,
    QWEN_MOE_WEIGHTS,
)

QWEN3_MOE = Architecture(
    "qwen3_moe", AttentionSpec(qk_norm=True), mlp=moe_mlp,
    weights=DECODER_WEIGHTS + ATTENTION_WEIGHTS + QK_NORM_WEIGHTS + QWEN_MOE_WEIGHTS + GATED_MLP_WEIGHTS,
    gguf_arch="qwen3moe")


class Qwen3MoeForCausalLM(CausalLM):
    architecture = QWEN3_MOE
