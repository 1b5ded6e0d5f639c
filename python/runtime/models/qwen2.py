"""Qwen2: the decoder parts with a bias on the q, k and v projections; with M-RoPE where the config has an
mrope_section (the language model of Qwen2-VL and Qwen2.5-VL, models/qwen2_vl.py)."""

from __future__ import annotations

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.layers.rotary import MRotaryEmbedding
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP, rope
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, GATED_MLP_WEIGHTS, QKV_BIAS_WEIGHTS


def rope_or_mrope(cfg: ModelConfig):
    if cfg.mrope_section is None:
        return rope(cfg)
    return MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.mrope_section)


QWEN2 = Architecture(
    "qwen2", AttentionSpec(qkv_bias=True, rotary=rope_or_mrope), mlp=GatedMLP,
    weights=DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + GATED_MLP_WEIGHTS, gguf_arch="qwen2")


class Qwen2ForCausalLM(CausalLM):
    architecture = QWEN2
