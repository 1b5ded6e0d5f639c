"""LLaVA's front end: transformers' CLIP image processor (its Pillow backend, which needs no torchvision) with the
checkpoint's preprocessor_config.json (without one: CLIP's defaults at the tower's image size), and one image
token per patch feature the model keeps (the class token too under the "full" select strategy)."""

from __future__ import annotations

import json
from pathlib import Path

from radixgen.runtime.media.processor import MediaProcessor, MediaTokens, ProcessedImage

PLACEHOLDER = "<image>"  # what LLaVA's chat templates and prompts write for an image


class LlavaProcessor(MediaProcessor):
    placeholder_text = PLACEHOLDER

    def __init__(self, hf_config: dict, model_path: Path) -> None:
        super().__init__(hf_config, model_path)
        from transformers import CLIPImageProcessorPil

        vc = hf_config["vision_config"]
        size = vc["image_size"]
        pre = Path(model_path) / "preprocessor_config.json"
        if pre.is_file():
            options = json.loads(pre.read_text())
            options.pop("image_processor_type", None)
            options.pop("processor_class", None)
            self.image_processor = CLIPImageProcessorPil(**options)
        else:
            self.image_processor = CLIPImageProcessorPil(size={"shortest_edge": size},
                                                         crop_size={"height": size, "width": size})
        self.image_token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32000)))
        self.span_ids = frozenset({self.image_token_id})
        patches = (size // vc["patch_size"]) ** 2
        self.num_tokens = patches + (1 if hf_config.get("vision_feature_select_strategy") == "full" else 0)
        self.image_size = size

    @property
    def fingerprint(self) -> str:
        opts = {k: v for k, v in self.image_processor.to_dict().items() if not k.startswith("_")}
        return f"llava|{json.dumps(opts, sort_keys=True, default=str)}"

    def process(self, image) -> ProcessedImage:
        pixels = self.image_processor(images=image, return_tensors="pt")["pixel_values"][0].float()  # (3, H, W)
        if tuple(pixels.shape[1:]) != (self.image_size, self.image_size):
            raise ValueError(f"image: processed to {tuple(pixels.shape[1:])} pixels, the vision tower takes "
                             f"{self.image_size}x{self.image_size} (check preprocessor_config.json)")
        p = self.hf_config["vision_config"]["patch_size"]
        return ProcessedImage(pixels, (self.image_size // p, self.image_size // p), self.num_tokens, image.size)

    def validate(self, item: ProcessedImage) -> None:
        shape = (3, self.image_size, self.image_size)
        if tuple(item.pixel_values.shape) != shape or item.num_tokens != self.num_tokens:
            raise ValueError(f"a processed image must have pixel values of shape {shape} and {self.num_tokens} "
                             f"tokens, got {tuple(item.pixel_values.shape)} and {item.num_tokens}")

    def tokens(self, item: ProcessedImage) -> MediaTokens:
        return MediaTokens([self.image_token_id] * item.num_tokens, 0, item.num_tokens)
