"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints, written with transformers' own config and model classes
(fixed seed), with the default model's tokenizer as tiny_models' text models have. The image placeholder and
vision start / end tokens are ids in the padded vocabulary rows past the tokenizer's, which no text encodes to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tiny_models import PADDED_VOCAB, build_once, copy_default_tokenizer

IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 49200, 49201, 49202, 49203
TEXT = dict(vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": [2, 3, 3]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    # window 56 px = 2 x 2 merged units: a 6 x 10 patch image has 6 windows, some cut short
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
}
PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}


def hf_vl_model(arch: str):
    import transformers as tf

    cls_cfg, cls_model = {"qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
                          "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration)}[arch]
    cfg = cls_cfg(text_config=TEXT, vision_config=VISION[arch], image_token_id=IMAGE_TOKEN,
                  video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                  tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = cls_model(cfg).eval()
    with torch.no_grad():  # larger than the default init, so logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.02)
    return model


def tiny_vl_dir(arch: str = "qwen2_vl", root: str | os.PathLike | None = None) -> Path:
    """Build (once per root) and return a folder with config, safetensors weights, tokenizer."""

    def build(tmp: Path) -> None:
        hf_vl_model(arch).save_pretrained(tmp)
        # small images (at most 64 merged patch blocks, 256 patches): fast tests
        (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        copy_default_tokenizer(tmp)

    return build_once(arch, root, build)


def random_image(seed: int, height: int, width: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_greedy_ids(model, px, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids` (the image's tokens in place) over the processed image `px`
    (runtime.media's Qwen2-VL processor output): the oracle the engine and server tests compare with."""
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=t, pixel_values=px.pixel_values, image_grid_thw=torch.tensor([px.grid]),
                             mm_token_type_ids=(t == IMAGE_TOKEN).int(), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
