"""Llama family (SmolLM2, Llama 2/3, TinyLlama, Mistral without sliding window): the plain decoder parts."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM, OtherStageLayer, StageHidden  # noqa: F401
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, GATED_MLP_WEIGHTS, QKV_BIAS_WEIGHTS

LLAMA = Architecture(
    "llama", AttentionSpec(), mlp=GatedMLP,
    # llama.cpp's llama files store Q / K rows in interleaved rotary pairs
    weights=(DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + GATED_MLP_WEIGHTS).with_rope_permuted(),
    gguf_arch="llama")


class LlamaForCausalLM(CausalLM):
    architecture = LLAMA
