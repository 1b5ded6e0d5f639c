"""The names of the architectures radixgen runs: a config's `architectures` entry -> our key, and where its model
class is declared (runtime/models/). Shared: the config resolves a checkpoint's architecture (and refuses one it
does not know) in any process without importing the model code, which only the model runner loads."""

from __future__ import annotations

# HF architecture name -> (our architecture key, module, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3", "Qwen3ForCausalLM"),
    # decoder bodies without an LM head: embedding models (runtime/pooling.py), the same model code
    "Qwen3Model": ("qwen3", "qwen3", "Qwen3ForCausalLM"),
    "Qwen2Model": ("qwen2", "qwen2", "Qwen2ForCausalLM"),
    "LlamaModel": ("llama", "llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "mixtral", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "phi3", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "smollm3", "SmolLM3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek_v2", "DeepseekV2ForCausalLM"),
    # vision-language models (models/multimodal.py; their image processors: runtime/media/)
    "LlavaForConditionalGeneration": ("llava", "llava", "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}


def architecture_of(hf_config: dict) -> str:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name][0]
    raise ValueError(
        f"unsupported architecture {names or hf_config.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
    )
