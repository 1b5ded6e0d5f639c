"""One file per architecture; the registry maps a config's `architectures` entry to a model class."""

from __future__ import annotations

import importlib

# HF architecture name -> (our architecture key, module, class)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3", "Qwen3ForCausalLM"),
}


def architecture_of(hf_config: dict) -> str:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name][0]
    raise ValueError(
        f"unsupported architecture {names or hf_config.get('model_type')!r}; supported: {sorted(_ARCHITECTURES)}"
    )


def model_class(architecture: str):
    for arch, module, cls in _ARCHITECTURES.values():
        if arch == architecture:
            return getattr(importlib.import_module(f"radixgen.runtime.models.{module}"), cls)
    raise ValueError(f"unknown architecture key {architecture!r}")
