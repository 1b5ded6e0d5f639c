"""The front end of a vision-language model: an image -> the pixels its encoder takes and the tokens it fills.

The image contract, end to end (the model's side is models/multimodal.py):

1. **Decoding** (common/media.py): a source (a path, bytes, base64, a data URL, a PIL image, an http(s) URL when
   remote media are allowed) -> an RGB `PIL.Image`, or a ValueError naming the problem.
2. **Processing** (here, in the Engine's process, off the event loop): the model's `MediaProcessor.process(image)`
   -> a `ProcessedImage`: `pixel_values` (a CPU float32 tensor in whatever layout the model's `encode` takes),
   `grid` (its shape in patches, model-specific: LLaVA (rows, cols); Qwen2-VL (t, h, w) before the merge) and
   `num_tokens` (the rows `encode` gives for it = the placeholder tokens of its span). `tokens(item)` gives the
   ids that stand for the image in the prompt (`MediaTokens`: the ids and the span [start, end) of them whose
   embeddings come from the encoder; LLaVA: n image tokens, all of the span; Qwen2-VL: vision_start, n pads,
   vision_end, the pads the span). `content_hash(item)`: the hash of the pixels, the grid and the processor's
   `fingerprint` (every processing option that changes the pixels): the image's identity for the radix tree
   (common.prompt.radix_key) and the encoder cache; equal pixels under equal options share, nothing else does.
3. **The prompt**: the Engine builds the request's ids with each image's `tokens` in its place and one
   `common.prompt.MediaItem(kind, content_hash, start, end, payload=ProcessedImage)` per image over its span;
   the `GenerateRequest` carries them to the scheduler (pickled: the pixels travel once, with the request).
   In a text prompt an image goes where `placeholder_text` stands (the text the chat template writes for an
   image part); images with no placeholder in the text go first, in order.
4. **Limits** checked in the Engine (RuntimeConfig): `max_image_pixels` (width * height of the decoded image),
   `max_images_per_request`; a model without a processor refuses images. Each a RequestError naming it.

A model registers its processor in `PROCESSORS` (our architecture key -> module of this package, class), which
both processes read without importing the model code.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

# our architecture key (runtime/architectures.py) -> (module in radixgen.runtime.media, class)
PROCESSORS: dict[str, tuple[str, str]] = {
    "llava": ("llava", "LlavaProcessor"),
    "qwen2_vl": ("qwen2_vl", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("qwen2_vl", "Qwen2VLProcessor"),
}


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as its model's encoder takes it. `size`: the decoded image's (width, height)."""

    pixel_values: torch.Tensor
    grid: tuple[int, ...]
    num_tokens: int
    size: tuple[int, int]
    extra: dict[str, Any] = field(default_factory=dict)  # anything else a model's encoder needs, by name

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"ProcessedImage.num_tokens must be >= 1, got {self.num_tokens}")


class MediaTokens(NamedTuple):
    """The ids that stand for one image in the prompt; ids[start:end] are its placeholder span, whose rows take
    the encoder's output (end - start == the item's num_tokens)."""

    ids: list[int]
    start: int
    end: int


class MediaProcessor:
    """A model's image front end; built once per Engine from the model's folder (config.json and its
    preprocessor_config.json where it has one). Subclasses set `placeholder_text` and implement `process`
    and `tokens`; `fingerprint` must name every option that changes the pixels."""

    kinds: tuple[str, ...] = ("image",)
    placeholder_text: str = ""
    # the ids of an image's span (ids[start:end] of its tokens): anywhere else in a prompt they would be embedded as
    # tokens with no image behind them, so the Engine refuses them there (empty: no check)
    span_ids: frozenset[int] = frozenset()

    def __init__(self, hf_config: dict, model_path: Path) -> None:
        self.hf_config, self.model_path = hf_config, Path(model_path)

    @property
    def fingerprint(self) -> str:
        raise NotImplementedError

    def process(self, image) -> ProcessedImage:
        """An RGB PIL image -> its ProcessedImage (a ValueError names an image the model cannot take)."""
        raise NotImplementedError

    def tokens(self, item: ProcessedImage) -> MediaTokens:
        raise NotImplementedError

    def validate(self, item: ProcessedImage) -> None:
        """A ProcessedImage given by a caller (not made by `process`): a ValueError unless the encoder takes it."""

    def content_hash(self, item: ProcessedImage) -> str:
        """blake2b of the processor's fingerprint, the grid and the pixel values' bytes (shape and dtype included)."""
        h = hashlib.blake2b(digest_size=20)
        px = item.pixel_values.detach().contiguous().cpu()
        h.update(f"{self.fingerprint}|{item.grid}|{tuple(px.shape)}|{px.dtype}|".encode())
        h.update(px.view(torch.uint8).numpy().tobytes() if px.numel() else b"")
        return h.hexdigest()


def processor_for(architecture: str, hf_config: dict, model_path: Path) -> MediaProcessor | None:
    """The processor of a model whose architecture key is `architecture`, or None for a text-only model."""
    entry = PROCESSORS.get(architecture)
    if entry is None:
        return None
    module, cls = entry
    return getattr(importlib.import_module(f"radixgen.runtime.media.{module}"), cls)(hf_config, model_path)
