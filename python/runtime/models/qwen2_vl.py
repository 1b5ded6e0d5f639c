"""Qwen2-VL and Qwen2.5-VL: a dynamic-resolution vision transformer (models/vision/qwen2_vit.py) whose merged
patch rows replace each image's placeholder tokens, over the Qwen2 decoder with M-RoPE positions. The front end
(the image processor, the placeholder ids) is runtime/media/qwen2_vl.py.

M-RoPE: a token has three position ids (temporal, height, width). Text tokens have three equal ids counting up
by one; an image's tokens, whose span starts where the next id would be s, are (s + frame, s + row, s + column)
over its merged grid, and the text after it goes on from s + max(rows, columns), one past the largest id the
image used. A row's ids are thus its sequence index plus the shifts of the images before it: every token after
a request's last image, each generated one included, is at index + delta with three equal ids, which rotate as
the plain rotary does (layers/rotary.MRotaryEmbedding), so decode steps keep the fused CPU step and CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.models.multimodal import StepMedia, VisionLanguageLM
from radixgen.runtime.models.vision.qwen2_vit import Qwen2VisionTransformer, VisionSpec


class ImageSpan(NamedTuple):
    """An image's placeholder span [start, end) in its prompt and its merged grid (frames, rows, columns)."""

    start: int
    end: int
    frames: int
    rows: int
    cols: int

    @property
    def shift(self) -> int:
        """How much later tokens' ids fall behind their index: the ids the image used minus its tokens."""
        return max(self.rows, self.cols) - (self.end - self.start)


def mrope_positions(index: torch.Tensor, spans: Sequence[ImageSpan]) -> tuple[torch.Tensor, bool]:
    """The (3, T) M-RoPE ids of one request's rows at sequence indices `index` (T,), given its images' spans (in
    order); and whether some row is inside an image (else the three rows are equal)."""
    out = index.to(torch.int64).unsqueeze(0).repeat(3, 1)
    shift, spatial = 0, False
    for s in spans:
        inside = (index >= s.start) & (index < s.end)
        if bool(inside.any()):
            j = index[inside] - s.start  # the token's place in the span: frame-, then row-major over the grid
            base = s.start + shift
            area = s.rows * s.cols
            out[0, inside] = base + j // area
            out[1, inside] = base + (j % area) // s.cols
            out[2, inside] = base + j % s.cols
            spatial = True
        out[:, index >= s.end] += s.shift
        shift += s.shift
    return out, spatial


class Qwen2VLForConditionalGeneration(VisionLanguageLM):
    """`language_model`: a Qwen2ForCausalLM with M-RoPE (its config's mrope_section); `visual`: the vision tower."""

    qwen2_5 = False

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, par)
        if cfg.mrope_section is None:
            raise ValueError(f"{cfg.architecture}: the config has no rope_scaling.mrope_section (M-RoPE)")
        hf = self.hf_config
        self.vision_spec = VisionSpec.from_hf(hf["vision_config"], self.qwen2_5)
        if self.vision_spec.out_dim != cfg.hidden_size:
            raise ValueError(f"the vision tower's output size {self.vision_spec.out_dim} is not the language "
                             f"model's hidden size {cfg.hidden_size}")
        self.visual = Qwen2VisionTransformer(self.vision_spec)

    def span(self, item) -> ImageSpan:
        """A MediaItem's ImageSpan (its payload a ProcessedImage of grid (t, h, w) in patches)."""
        if item.kind != "image":
            raise ValueError(f"{self.config.architecture}: media of kind {item.kind!r} are not supported (images)")
        t, h, w = item.payload.grid
        m = self.vision_spec.merge_size
        s = ImageSpan(item.start, item.end, t, h // m, w // m)
        if s.frames * s.rows * s.cols != item.end - item.start:
            raise ValueError(f"an image of grid {(t, h, w)} spans {item.end - item.start} placeholder tokens, "
                             f"not {s.frames * s.rows * s.cols}")
        return s

    def positions(self, positions: torch.Tensor, step: StepMedia) -> torch.Tensor:
        """(3, T) M-RoPE ids where some row of the step is inside an image; otherwise (T,) ids offset by each
        request's delta (text after its images: decode steps, and chunks past the images). Called every step
        of a batch with images: a request whose rows are all past its images costs a few Python operations."""
        index = positions.to("cpu", torch.int64)
        starts = index.tolist()
        deltas, inside, row = [], [], 0  # per row: its offset; the requests with rows inside an image
        for e, items in zip(step.extend_lens, step.items, strict=True):
            spans = sorted((self.span(it) for it in items), key=lambda s: s.start)
            if spans and min(starts[row:row + e]) < spans[-1].end:
                inside.append((row, e, spans))
                deltas += [0] * e
            else:
                deltas += [sum(s.shift for s in spans)] * e
            row += e
        plain = index + torch.tensor(deltas, dtype=torch.int64)
        if not inside:
            return plain.to(positions.device)
        out = plain.unsqueeze(0).repeat(3, 1)
        spatial = False
        for row, e, spans in inside:
            out[:, row:row + e], some = mrope_positions(index[row:row + e], spans)
            spatial |= some
        return (out if spatial else out[0].contiguous()).to(positions.device)

    def encode(self, items: list) -> list[torch.Tensor]:
        """Every item's patch rows through the tower in one pass (attention stays within each image)."""
        if not items:
            return []
        patches = torch.cat([it.pixel_values for it in items]).to(self.visual.inv_freq.device)
        grids = [tuple(int(v) for v in it.grid) for it in items]
        out = list(self.visual(patches, grids).split([it.num_tokens for it in items]))
        for it, o, g in zip(items, out, grids, strict=True):
            m2 = self.vision_spec.merge_size ** 2
            if o.shape[0] != it.num_tokens or g[0] * g[1] * g[2] != it.num_tokens * m2:
                raise ValueError(f"an image of grid {g} gives {g[0] * g[1] * g[2] // m2} rows, its item says "
                                 f"{it.num_tokens}")
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names: the language model's under "model." (transformers >= 5's in-memory layout:
        "model.language_model."), the vision tower's under "visual." ("model.visual."), "lm_head."."""
        filled: set[str] = set()

        def language():
            for name, tensor in weights:
                short = name.removeprefix("model.")
                if short.startswith("visual."):
                    filled.update(self.visual.load_weights([(short.removeprefix("visual."), tensor)]))
                    continue
                yield name.replace("model.language_model.", "model."), tensor

        self.language_model.load_weights(language())
        missing = {n for n, _ in self.visual.named_parameters()} - filled
        if missing:
            raise ValueError(f"checkpoint is missing vision tensors: {sorted(missing)[:8]}")


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 - the HF class name
    """Qwen2.5-VL: the same language model; the vision tower with window attention, RMSNorm and gated MLPs."""

    qwen2_5 = True
