"""Mixtral: Llama's attention and an expert block in every layer (block_sparse_moe: softmax over the experts,
top-k, always renormalised; experts w1 = gate, w3 = up, w2 = down). llama.cpp writes Mixtral GGUF files as its
"llama" architecture with expert tensors (models.for_gguf tells them apart by their expert count)."""

from __future__ import annotations

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.moe_block import moe_mlp
from radixgen.runtime.models.parts import AttentionSpec
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, MIXTRAL_WEIGHTS, QKV_BIAS_WEIGHTS

MIXTRAL = Architecture(
    "mixtral", AttentionSpec(), mlp=moe_mlp,
    weights=(DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + MIXTRAL_WEIGHTS).with_rope_permuted(),
    gguf_arch="llama")


class MixtralForCausalLM(CausalLM):
    architecture = MIXTRAL
