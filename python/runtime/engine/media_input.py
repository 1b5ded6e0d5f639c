"""Images into requests, in the Engine's process: `image_data` beside text prompts -> `Prompt`s with media
segments, and every media segment decoded (common/media.py), checked against the limits and processed by the
model's processor (runtime/media/processor.py) into the ids that stand for it and its `MediaItem`.

`image_data` follows SGLang's /generate: for one prompt, one image source or a list of them; for a list of
prompts, a list with one entry (a source, a list of sources, or None) per prompt. In a text prompt each image
goes where the model's placeholder text stands ("<image>" for LLaVA); images beyond the placeholders go first,
in order (after the start-of-text tokens). More placeholders than images is an error naming both counts.
Every problem is a RequestError naming the prompt, the image and why.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NamedTuple

from radixgen.common.media import MediaError, load_image
from radixgen.common.prompt import MediaSegment, Prompt, TextSegment, TokenSegment
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine.request_state import RequestError
from radixgen.runtime.media.processor import MediaProcessor, MediaTokens, ProcessedImage, processor_for


class ProcessedSegment(NamedTuple):
    """One media segment once processed: the ids standing for it, its content hash, the encoder's input."""

    tokens: MediaTokens
    content_hash: str
    item: ProcessedImage


class MediaFrontEnd:
    def __init__(self, processor: MediaProcessor | None, config: RuntimeConfig, architecture: str) -> None:
        self.processor, self.config, self.architecture = processor, config, architecture

    @classmethod
    def for_model(cls, architecture: str, hf_config: dict, model_path: Path, config: RuntimeConfig) -> MediaFrontEnd:
        return cls(processor_for(architecture, hf_config, model_path), config, architecture)

    @property
    def image_token(self) -> str | None:
        """The text that marks an image's place in a prompt (None: the model takes no images)."""
        return self.processor.placeholder_text if self.processor is not None else None

    # ------------------------------------------------------------------ image_data -> prompts

    def with_images(self, prompt: Any, image_data: Any) -> Any:
        """The `prompt` argument with `image_data` folded in: Prompt(s) with media segments."""
        if image_data is None:
            return prompt
        batched = isinstance(prompt, (list, tuple))
        texts = list(prompt) if batched else [prompt]
        if not all(isinstance(t, str) for t in texts):
            raise RequestError("image_data: goes with a text prompt (a string or a list of strings); a Prompt "
                               "carries its images as MediaSegments")
        if batched:
            if not isinstance(image_data, (list, tuple)) or len(image_data) != len(texts):
                raise RequestError(f"image_data: for {len(texts)} prompts, give a list with one entry per prompt "
                                   f"(an image, a list of images, or None)")
            per_prompt = [_as_list(d) for d in image_data]
        else:
            per_prompt = [_as_list(image_data)]
        out = [self.split(t, imgs, f"prompt[{i}]" if batched else "prompt")
               for i, (t, imgs) in enumerate(zip(texts, per_prompt, strict=True))]
        return out if batched else out[0]

    def split(self, text: str, images: list, where: str) -> Prompt:
        """`text` cut at its image placeholders, each image in its place (extra images first)."""
        if not images:
            return Prompt.of(text)
        self.check_images(len(images), where)
        mark = self.processor.placeholder_text
        pieces = text.split(mark)
        holes = len(pieces) - 1
        if holes > len(images):
            raise RequestError(f"{where}: {holes} image placeholders ({mark!r}) for {len(images)} images")
        pieces = [""] * (len(images) - holes) + pieces  # the images without a placeholder go first
        segments: list = [TextSegment(pieces[0])]
        for img, piece in zip(images, pieces[1:], strict=True):
            segments.append(MediaSegment.image(img))
            if piece:
                segments.append(TextSegment(piece))
        return Prompt(tuple(segments))

    def check_images(self, count: int, where: str) -> None:
        if self.processor is None:
            raise RequestError(f"{where}: image input is not supported: the served model ({self.architecture}) "
                               f"takes text only")
        if count > self.config.max_images_per_request:
            raise RequestError(f"{where}: {count} images, more than the limit of "
                               f"{self.config.max_images_per_request} per request (--max-images-per-request)")

    def check_placeholders(self, ids_list: list[list[int]], media: list[tuple], batched: bool) -> None:
        """No prompt holds an image's span id outside its images' spans (the text "<image>" with no image given,
        or such an id in input_ids): it would be embedded as a token with no image behind it."""
        span_ids = self.processor.span_ids if self.processor is not None else frozenset()
        if not span_ids:
            return
        for i, (ids, items) in enumerate(zip(ids_list, media or [()] * len(ids_list), strict=True)):
            inside = sum(it.end - it.start for it in items)
            if sum(1 for t in ids if t in span_ids) != inside:
                where = f"prompt[{i}]" if batched else "prompt"
                raise RequestError(f"{where}: holds the image placeholder token (id {min(span_ids)}) where no image "
                                   f"is given; give one image per placeholder ({self.processor.placeholder_text!r})")

    # ------------------------------------------------------------------ processing

    def process(self, prompts: list[Prompt], batched: bool) -> list[list[ProcessedSegment]]:
        """Every media segment of every prompt, in order: decoded, checked, processed, hashed."""
        out = []
        for i, p in enumerate(prompts):
            where = f"prompt[{i}]" if batched else "prompt"
            media = p.media
            if media:
                self.check_images(len(media), where)
            out.append([self.process_one(seg, f"{where} image {k}") for k, seg in enumerate(media)])
        return out

    def process_one(self, seg: MediaSegment, where: str) -> ProcessedSegment:
        if isinstance(seg.payload, ProcessedImage):  # processed already (tokenized_prompt's, or a caller's)
            try:
                self.processor.validate(seg.payload)
            except ValueError as e:
                raise RequestError(f"{where}: {e}") from None
            return ProcessedSegment(self.processor.tokens(seg.payload),
                                    seg.content_hash or self.processor.content_hash(seg.payload), seg.payload)
        if seg.kind not in self.processor.kinds:
            raise RequestError(f"{where}: {seg.kind} input is not supported by the served model "
                               f"({self.architecture}; it takes {', '.join(self.processor.kinds)})")
        c = self.config
        try:
            image = load_image(seg.payload, allow_remote=c.allow_remote_media, max_bytes=c.max_media_bytes,
                               timeout_s=c.media_fetch_timeout_s, max_pixels=c.max_image_pixels,
                               local_root=c.allowed_local_media_path)
            item = self.processor.process(image)
        except MediaError as e:
            raise RequestError(f"{where}: {str(e).removeprefix('image: ')}") from None
        except (ValueError, OSError) as e:
            raise RequestError(f"{where}: the image could not be processed: {e}") from None
        return ProcessedSegment(self.processor.tokens(item), seg.content_hash or self.processor.content_hash(item),
                                item)


    def tokenized_prompt(self, text: str, images: list, tokenize, where: str,
                         add_special_tokens: bool = False) -> tuple[Prompt, list[int]]:
        """A prompt `text` with its image placeholders and `images`: a Prompt of token segments and processed
        media segments, and its ids (the images' tokens in their places), for a caller that needs the length
        (a token budget) or the ids. `add_special_tokens`: for the first text (a plain prompt); a rendered chat
        prompt has its special tokens written already."""
        prompt = self.split(text, images, where)
        media = iter([self.process_one(seg, f"{where} image {k}") for k, seg in enumerate(prompt.media)])
        texts = [s.text for s in prompt.segments if isinstance(s, TextSegment)]
        tokenized = iter(tokenize(texts[:1], add_special_tokens=add_special_tokens)
                         + tokenize(texts[1:], add_special_tokens=False))
        out, ids = [], []
        for s in prompt.segments:
            if isinstance(s, TextSegment):
                seg_ids = next(tokenized)
                ids += seg_ids
                out.append(TokenSegment(tuple(seg_ids)))
            else:
                done = next(media)
                ids += done.tokens.ids
                out.append(MediaSegment(s.kind, done.item, done.content_hash))
        return Prompt(tuple(out)), ids


def salted(media: list[list[ProcessedSegment]], cache_salt: str | None) -> list[list[ProcessedSegment]]:
    """Each segment's content hash inside the request's cache salt (under per-key isolation, the API key's
    namespace): the encoder cache keys embeddings by it, so that one key can never learn from the encoder
    cache's hits whether another sent an image. Unsalted requests share entries as before."""
    if cache_salt is None:
        return media
    mix = lambda h: hashlib.sha256(f"{cache_salt}\x00{h}".encode()).hexdigest()  # noqa: E731
    return [[seg._replace(content_hash=mix(seg.content_hash)) for seg in segs] for segs in media]


def _as_list(data: Any) -> list:
    if data is None:
        return []
    return list(data) if isinstance(data, (list, tuple)) else [data]
