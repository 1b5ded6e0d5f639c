"""Random LoRA adapters made with `peft` on the tiny models (tests/tiny_models.py): saved as PEFT folders for
radixgen to load, and kept as PEFT models for the oracle (transformers' forward with the adapter applied)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import tiny_model_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(arch: str, folder: Path, rank: int = 4, targets=ALL, seed: int = 0, alpha: float | None = None,
                 use_rslora: bool = False, b_std: float = 0.08):
    """Save a random adapter for tiny model `arch` in `folder` (A and B both random, so its delta shows);
    return the PEFT model (float32, eval) that applies it."""
    import peft
    import transformers as tf

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                          init_lora_weights=False, use_rslora=use_rslora)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    model.save_pretrained(str(folder))
    return model.eval()


def base_model(arch: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` by a transformers (or PEFT) model, one forward per token (no cache tricks)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
