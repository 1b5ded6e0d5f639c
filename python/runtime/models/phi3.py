"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder, its checkpoint holding q, k, v in one qkv_proj tensor and
gate, up in one gate_up_proj tensor, loaded here as their parts (so tensor parallelism cuts each part); a sliding
window where the config has one (Phi-3-mini-4k)."""

from __future__ import annotations

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP
from radixgen.runtime.models.weights import (
    ATTENTION_WEIGHTS,
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    WeightMapping,
    split_fused,
)

# llama.cpp's phi3 files keep the fused tensors (ffn_up: gate and up); listed first, so they win over the parts'
PHI3_GGUF = WeightMapping(gguf_block=(("attn_qkv.weight", "self_attn.qkv_proj.weight"),
                                      ("ffn_up.weight", "mlp.gate_up_proj.weight")))
PHI3 = Architecture("phi3", AttentionSpec(), mlp=GatedMLP,
                    weights=PHI3_GGUF + DECODER_WEIGHTS + ATTENTION_WEIGHTS + GATED_MLP_WEIGHTS, gguf_arch="phi3")


class Phi3ForCausalLM(CausalLM):
    architecture = PHI3

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        hf = cfg.hf or {}
        factor = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise ValueError(f"Phi-3: partial_rotary_factor={factor} is not supported (rotary over the whole head "
                             f"only)")
        super().__init__(cfg, par)

    def load_weights(self, weights) -> None:
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        super().load_weights(split_fused(weights, {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))}))
