"""Tiny random models (Llama, Qwen2, Qwen3; Qwen3-MoE, Qwen2-MoE, Mixtral) from a transformers config, fixed seed.

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
    # mixtures of experts: 8 experts, top 2 (Qwen2-MoE: a shared expert, and a dense layer 1 by mlp_only_layers)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, head_dim=16, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**_COMMON, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])
    if arch == "qwen2_moe-wide":  # intermediate sizes tp 2 cuts into whole 16-column blocks (the fused C step's)
        return tf.Qwen2MoeConfig(**_COMMON, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1])
    if arch == "mixtral":
        return tf.MixtralConfig(**{**_COMMON, "intermediate_size": 32}, rope_theta=10000.0, num_local_experts=8,
                                num_experts_per_tok=2)
    return _window_config(arch)


WINDOW = 6  # the sliding window of the tiny window models: prompts of the tests are longer


def _window_config(arch: str):
    """Architectures with sliding windows, soft-caps, sinks, sandwich norms, fused projections or layers without
    rotary (tests/runtime/test_window_models.py)."""
    import transformers as tf

    hd = dict(_COMMON, head_dim=16)
    if arch == "mistral-window":  # every layer windowed
        return tf.MistralConfig(**hd, sliding_window=WINDOW, rope_theta=10000.0)
    if arch == "qwen2-window":  # Qwen2's max_window_layers: layer 0 full, layer 1 windowed
        return tf.Qwen2Config(**_COMMON, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    if arch == "gemma2":
        return tf.Gemma2Config(**{**hd, "tie_word_embeddings": True}, sliding_window=WINDOW,
                               query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                               pad_token_id=0)
    if arch == "gemma3":  # local (10k, unscaled) and global (1M, linear x8) rotary, q / k norms
        return tf.Gemma3TextConfig(**{**hd, "tie_word_embeddings": True}, sliding_window=WINDOW,
                                   query_pre_attn_scalar=16, pad_token_id=0,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6}})
    if arch == "phi3":  # fused qkv_proj and gate_up_proj checkpoint tensors
        return tf.Phi3Config(**_COMMON, rope_theta=10000.0, pad_token_id=0)
    if arch == "smollm3":  # every 4th layer without rotary (the default pattern, which llama.cpp's files imply)
        return tf.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4}, rope_theta=10000.0, pad_token_id=0)
    if arch == "gpt_oss":  # sinks, windows on even layers, yarn rotary, 4 experts of a clamped swiglu, biases
        return tf.GptOssConfig(**{**hd, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=WINDOW, pad_token_id=0,
                               rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 256, "rope_theta": 150000.0})
    if arch == "deepseek_v2":  # latent attention (yarn with mscale), dense layer 0, 4 experts + 2 shared after it
        return tf.DeepseekV2Config(**{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
                                   first_k_dense_replace=1, routed_scaling_factor=1.5, pad_token_id=0,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                                    "original_max_position_embeddings": 256, "rope_theta": 10000.0})
    raise ValueError(arch)


def tiny_window_model_dir(arch: str, root: str | os.PathLike | None = None) -> Path:
    """tiny_model_dir for _window_config's architectures: every parameter drawn at random, vectors too (norm
    weights, biases, sinks: their defaults would hide a wrong formula)."""
    import transformers as tf

    def build(tmp: Path) -> None:
        torch.manual_seed(1234)
        model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.2)
        model.save_pretrained(tmp)
        copy_default_tokenizer(tmp)

    return build_once(arch, root, build)


def tiny_model_dir(arch: str = "llama", root: str | os.PathLike | None = None) -> Path:
    """Build (once per root) and return a folder with config, safetensors weights and tokenizer."""
    import transformers as tf

    def build(tmp: Path) -> None:
        torch.manual_seed(1234)
        model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
        with torch.no_grad():  # larger than the default init, so logits are far from uniform
            for p in model.parameters():
                if p.dim() >= 2:  # (an MoE's experts are stacked (E, out, in) in transformers)
                    p.normal_(0.0, 0.08)
        model.save_pretrained(tmp)
        copy_default_tokenizer(tmp)

    return build_once(arch, root, build)


def build_once(name: str, root: str | os.PathLike | None, build) -> Path:
    """The tiny-model folder `name` under root (default $RADIXGEN_CACHE or ~/.cache/radixgen) /tiny, made by
    build(tmp folder) the first time, published whole (another process may build it at the same time)."""
    root = Path(root or os.environ.get("RADIXGEN_CACHE", Path.home() / ".cache" / "radixgen")) / "tiny"
    out = root / name
    if (out / "DONE").exists():
        return out
    tmp = root / f"{name}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    build(tmp)
    return _publish(tmp, out)


def copy_default_tokenizer(folder: Path) -> None:
    """The default model's tokenizer and chat template files into `folder`."""
    from radixgen.runtime.loader import resolve_model_path

    for f in resolve_model_path(None).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, folder / f.name)


def _publish(tmp: Path, out: Path) -> Path:
    """Move a finished model folder into place (another process may have been first: then drop ours)."""
    (tmp / "DONE").write_text("ok\n")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def perturbed_model_dir(arch: str = "llama", noise: float = 0.02, root: str | os.PathLike | None = None) -> Path:
    """A copy of tiny_model_dir(arch) with N(0, noise) added to every weight matrix (fixed seed): a different
    model of the same vocabulary whose greedy choices mostly, not always, agree with the original's (a draft
    model for speculative decoding tests)."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir(arch, root)
    out = src.parent / f"{arch}-perturbed-{noise}"
    if (out / "DONE").exists():
        return out
    tmp = src.parent / f"{out.name}.tmp{os.getpid()}"
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    (tmp / "DONE").unlink()
    gen = torch.Generator().manual_seed(99)
    for f in tmp.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.dim() == 2:
                tensors[name] = t + noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return _publish(tmp, out)
