"""Tiny random models (Llama, Qwen2, Qwen3) built from a transformers config with a fixed seed.

They carry the default model's tokenizer, so every runtime path (detokenization, grammars) runs on a
real vocabulary; their vocab is padded past the tokenizer's (49152 -> 49216) so tests can check that
padded rows are never sampled.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

TOKENIZER_VOCAB = 49152
PADDED_VOCAB = 49216

_COMMON = dict(vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, rope_theta=10000.0)
    if arch == "llama3":  # Llama 3 rope scaling
        return tf.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256})
    if arch == "llama-tied":
        return tf.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON, rope_theta=1000000.0)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16, rope_theta=1000000.0)
    # head sizes the CPU extend kernel takes (a multiple of 32)
    if arch == "llama-hd64":
        return tf.LlamaConfig(**{**_COMMON, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
                              rope_theta=10000.0)
    if arch == "llama-odd":  # tp 2 splits it unevenly: 3 KV heads (2 + 1), 129 MLP columns, an odd vocabulary
        return tf.LlamaConfig(**{**_COMMON, "vocab_size": PADDED_VOCAB + 1, "hidden_size": 96, "intermediate_size": 129,
                                 "num_attention_heads": 6, "num_key_value_heads": 3}, rope_theta=10000.0)
    if arch == "qwen3-hd32":
        return tf.Qwen3Config(**_COMMON, head_dim=32, rope_theta=1000000.0)
    raise ValueError(arch)


def tiny_model_dir(arch: str = "llama", root: str | os.PathLike | None = None) -> Path:
    """Build (once per root) and return a folder with config, safetensors weights and tokenizer."""
    import transformers as tf

    from radixgen.runtime.loader import resolve_model_path

    root = Path(root or os.environ.get("RADIXGEN_CACHE", Path.home() / ".cache" / "radixgen")) / "tiny"
    out = root / arch
    if (out / "DONE").exists():
        return out
    tmp = root / f"{arch}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(tmp)
    default = resolve_model_path(None)
    for f in default.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    (tmp / "DONE").write_text("ok\n")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
