"""SmolLM3: the Llama decoder where some layers have no rotary (config.no_rope_layers: 1 rotates, 0 does not; by
default every 4th layer has none); a sliding window where the config asks for one."""

from __future__ import annotations

from torch import nn

from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, DecoderLayer, GatedMLP
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, GATED_MLP_WEIGHTS, QKV_BIAS_WEIGHTS

# llama.cpp's smollm3 files: Llama's names, Q / K rows in its interleaved rotary order, every 4th layer without
# rotary (runtime/gguf_arch.py); their tokenizer is read from the file's fields (transformers refuses the file)
SMOLLM3 = Architecture("smollm3", AttentionSpec(), mlp=GatedMLP, gguf_arch="smollm3",
                       weights=(DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS
                                + GATED_MLP_WEIGHTS).with_rope_permuted())


class SmolLM3ForCausalLM(CausalLM):
    architecture = SMOLLM3

    def make_layer(self, i: int) -> nn.Module:
        cfg, arch = self.config, self.architecture
        flags = (cfg.hf or {}).get("no_rope_layers")
        if flags is None:
            interval = (cfg.hf or {}).get("no_rope_layer_interval", 4)
            flags = [int((j + 1) % interval != 0) for j in range(cfg.num_layers)]
        if len(flags) != cfg.num_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for num_hidden_layers={cfg.num_layers}")
        return DecoderLayer(cfg, self.parallel, i - self.start_layer, arch.attention, arch.mlp,
                            self.rotary if flags[i] else None, index=i)
