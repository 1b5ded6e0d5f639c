"""LoRA adapters: loading and validating PEFT adapter folders (serving them is not wired yet)."""

from radixgen.runtime.lora.adapter import LoRAAdapter, LoRAAdapterError, check_adapter_fits, load_lora_adapter

__all__ = ["LoRAAdapter", "LoRAAdapterError", "check_adapter_fits", "load_lora_adapter"]
