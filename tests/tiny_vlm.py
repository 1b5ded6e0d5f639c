"""Tiny random vision-language checkpoints written with transformers' own config and model classes (fixed seed),
with the default model's tokenizer plus an "<image>" token (id 49152, inside the padded vocabulary), a chat
template, and the image processor's preprocessor_config.json; and small test images made with Pillow."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import torch
from tiny_models import PADDED_VOCAB, build_once

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 49152
IMAGE_SIZE, PATCH = 32, 8  # 16 patches: 16 image tokens under the default select strategy


def llava_config(text: str = "llama", **over):
    import transformers as tf

    common = dict(vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    tc = tf.LlamaConfig(**common, rope_theta=10000.0) if text == "llama" else tf.Qwen2Config(**common,
                                                                                            rope_theta=1e6)
    vc = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                             image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    return tf.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN_ID,
                          projector_hidden_act="gelu", **over)


def tiny_llava_dir(text: str = "llama", root: str | os.PathLike | None = None, **over) -> Path:
    """Build (once per root and variant) a LLaVA folder: config, safetensors, tokenizer, preprocessor config."""
    import transformers as tf

    from radixgen.runtime.loader import resolve_model_path

    def build(tmp: Path) -> None:
        torch.manual_seed(1234)
        model = tf.LlavaForConditionalGeneration(llava_config(text, **over)).to(torch.float32)
        with torch.no_grad():  # larger than the default init, so logits are far from uniform
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
        model.save_pretrained(tmp)
        tok = tf.AutoTokenizer.from_pretrained(resolve_model_path(None))
        tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
        tok.save_pretrained(tmp)
        tf.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(tmp)

    return build_once(f"llava-{text}" + "".join(f"-{k}{v}" for k, v in sorted(over.items())), root, build)


def make_image(seed: int = 0, size: tuple[int, int] = (48, 40)):
    """A random RGB PIL image (a fixed seed: the same pixels every time)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(arr.numpy(), "RGB")


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_pixels(model_dir: Path, img) -> torch.Tensor:
    """transformers' own processing of `img` for the checkpoint: (1, 3, H, W)."""
    import transformers as tf

    return tf.CLIPImageProcessorPil.from_pretrained(model_dir)(images=img, return_tensors="pt")["pixel_values"]


def clear(model_dir: Path) -> None:
    shutil.rmtree(model_dir, ignore_errors=True)


def choice_mean_logprobs(logits_of, prompt_ids: list[int], fulls: list[list[int]]) -> list[float]:
    """By hand: each choice's mean token logprob after the prompt, from the logits of a whole forward over the
    prompt and the choice (`logits_of(ids)` -> (len(ids), vocab)); the span starts where the ids part from the
    prompt's (a choice may merge with the prompt's last token)."""
    out = []
    for full in fulls:
        k = next((i for i, (a, b) in enumerate(zip(prompt_ids, full, strict=False)) if a != b),
                 min(len(prompt_ids), len(full)))
        logprobs = torch.log_softmax(logits_of(full).double(), dim=-1)
        out.append(sum(logprobs[j - 1, full[j]].item() for j in range(k, len(full))) / (len(full) - k))
    return out
