"""Qwen2: the Llama block with a bias on the q, k and v projections (set from the config)."""

from __future__ import annotations

from radixgen.runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
