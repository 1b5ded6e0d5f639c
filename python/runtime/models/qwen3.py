"""Qwen3: the decoder parts with an RMSNorm over each query and key head before the rotation."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP
from radixgen.runtime.models.weights import (
    ATTENTION_WEIGHTS,
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    QK_NORM_WEIGHTS,
    QKV_BIAS_WEIGHTS,
)

QWEN3 = Architecture(
    "qwen3", AttentionSpec(qk_norm=True), mlp=GatedMLP,
    weights=DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + QK_NORM_WEIGHTS + GATED_MLP_WEIGHTS,
    gguf_arch="qwen3")


class Qwen3ForCausalLM(CausalLM):
    architecture = QWEN3
