"""Qwen2-VL's and Qwen2.5-VL's front end: transformers' Qwen2-VL image processor (its Pillow backend, which
needs no torchvision) with the checkpoint's preprocessor_config.json (min / max pixels, mean, std). An image is
resized to a multiple of patch x merge pixels on each side within [min_pixels, max_pixels], keeping its aspect
ratio, and cut into patches (dynamic resolution: no fixed grid); it stands in the prompt as vision_start, one
image pad per merged patch block, vision_end, the pads its span."""

from __future__ import annotations

import json
from pathlib import Path

from radixgen.runtime.media.processor import MediaProcessor, MediaTokens, ProcessedImage

# what Qwen2-VL's chat template writes for an image part
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_NOT_OPTIONS = ("image_processor_type", "processor_class", "auto_map")


class Qwen2VLProcessor(MediaProcessor):
    placeholder_text = PLACEHOLDER

    def __init__(self, hf_config: dict, model_path: Path) -> None:
        super().__init__(hf_config, model_path)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vc = hf_config["vision_config"]
        shape = {"patch_size": vc.get("patch_size", 14), "temporal_patch_size": vc.get("temporal_patch_size", 2),
                 "merge_size": vc.get("spatial_merge_size", 2)}
        pre = Path(model_path) / "preprocessor_config.json"
        options = json.loads(pre.read_text()) if pre.is_file() else {}
        for key in _NOT_OPTIONS:
            options.pop(key, None)
        for key, value in shape.items():  # the vision tower's, which the pixels must fit
            if options.setdefault(key, value) != value:
                raise ValueError(f"preprocessor_config.json: {key}={options[key]}, the vision tower's is {value}")
        self.image_processor = Qwen2VLImageProcessorPil(**options)
        self.merge = shape["merge_size"]
        self.patch_features = vc.get("in_channels", 3) * shape["temporal_patch_size"] * shape["patch_size"] ** 2
        self.ids = (int(hf_config.get("vision_start_token_id", 151652)), int(hf_config.get("image_token_id", 151655)),
                    int(hf_config.get("vision_end_token_id", 151653)))
        self.span_ids = frozenset({self.ids[1]})

    @property
    def fingerprint(self) -> str:
        opts = {k: v for k, v in self.image_processor.to_dict().items() if not k.startswith("_")}
        return f"qwen2_vl|{json.dumps(opts, sort_keys=True, default=str)}"

    def process(self, image) -> ProcessedImage:
        out = self.image_processor(images=image, return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])  # (t, h, w) in patches
        t, h, w = grid
        return ProcessedImage(out["pixel_values"].float(), grid, t * h * w // self.merge ** 2, image.size)

    def validate(self, item: ProcessedImage) -> None:
        grid, px = item.grid, item.pixel_values
        if len(grid) != 3 or grid[1] % self.merge or grid[2] % self.merge or min(grid) < 1:
            raise ValueError(f"a processed image's grid must be (t, h, w) patches, h and w multiples of {self.merge}; "
                             f"got {tuple(grid)}")
        t, h, w = grid
        if tuple(px.shape) != (t * h * w, self.patch_features) or item.num_tokens != t * h * w // self.merge ** 2:
            raise ValueError(f"a processed image of grid {tuple(grid)} must have pixel values of shape "
                             f"{(t * h * w, self.patch_features)} and {t * h * w // self.merge ** 2} tokens, got "
                             f"{tuple(px.shape)} and {item.num_tokens}")

    def tokens(self, item: ProcessedImage) -> MediaTokens:
        start, pad, end = self.ids
        return MediaTokens([start] + [pad] * item.num_tokens + [end], 1, 1 + item.num_tokens)
