"""Qwen2: the decoder parts with a bias on the q, k and v projections."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, GATED_MLP_WEIGHTS, QKV_BIAS_WEIGHTS

QWEN2 = Architecture(
    "qwen2", AttentionSpec(qkv_bias=True), mlp=GatedMLP,
    weights=DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + GATED_MLP_WEIGHTS, gguf_arch="qwen2")


class Qwen2ForCausalLM(CausalLM):
    architecture = QWEN2
