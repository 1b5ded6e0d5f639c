"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with M-RoPE positions, behind a dynamic-resolution vision
transformer (models/vision/qwen2_vit.py) whose merged patch rows replace the image's placeholder tokens.

M-RoPE: a token has three position ids (temporal, height, width). Text tokens have three equal ids that count
up by one; an image's tokens, starting at the next id s, have (s + frame, s + row, s + column) over its merged
grid, and the text after the image goes on from one past the largest id the image used. So a request's
positions are its sequence indices plus a per-request offset `delta` (<= 0) from its last image on: every
token generated after the prompt is at index + delta, three equal ids, which rotate as the plain rotary does
(layers/rotary.MRotaryEmbedding).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.layers.rotary import MRotaryEmbedding
from radixgen.runtime.models.decoder import Architecture, CausalLM, StageHidden
from radixgen.runtime.models.parts import AttentionSpec, GatedMLP
from radixgen.runtime.models.vision.qwen2_vit import Qwen2VisionTransformer, VisionSpec
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, GATED_MLP_WEIGHTS, QKV_BIAS_WEIGHTS
from radixgen.runtime.parallel_context import SINGLE, ParallelContext


def mrope(cfg: ModelConfig) -> MRotaryEmbedding:
    if cfg.mrope_section is None:
        raise ValueError("a Qwen2-VL config without rope_scaling.mrope_section")
    return MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.mrope_section)


QWEN2_VL = Architecture(
    "qwen2_vl", AttentionSpec(qkv_bias=True, rotary=mrope), mlp=GatedMLP,
    weights=DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS + GATED_MLP_WEIGHTS)


class MRopePositions(NamedTuple):
    """A prompt's M-RoPE position ids (3, L) and the offset of every later token: position = index + delta."""

    positions: torch.Tensor
    delta: int


def mrope_positions(token_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                    merge_size: int) -> MRopePositions:
    """The M-RoPE positions of a prompt whose images (grids (t, h, w) in patches, in order) each stand as
    t * h * w / merge^2 consecutive `image_token_id` tokens."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    out = torch.empty(3, ids.numel(), dtype=torch.int64)
    is_image = (ids == image_token_id).tolist()
    next_id, i, pending = 0, 0, list(grids)
    n = len(is_image)
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = torch.arange(next_id, next_id + j - i)
            next_id += j - i
            i = j
            continue
        if not pending:
            raise ValueError("more image placeholder tokens in the prompt than its images' grids account for")
        t, h, w = pending.pop(0)
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if i + count > n or not all(is_image[i:i + count]):
            raise ValueError(f"an image of grid {(t, h, w)} needs {count} consecutive placeholder tokens")
        frame = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
        row = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        col = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        out[:, i:i + count] = torch.stack([frame, row, col]).reshape(3, count) + next_id
        next_id += max(t, gh, gw)
        i += count
    if pending:
        raise ValueError(f"{len(pending)} image(s) without their placeholder tokens in the prompt")
    return MRopePositions(out, next_id - n)


class Qwen2VLForConditionalGeneration(CausalLM):
    """The language model (a CausalLM over the M-RoPE decoder) and, on the first pipeline stage, the vision
    tower (`visual`), replicated on every tensor-parallel rank."""

    architecture = QWEN2_VL
    qwen2_5 = False

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, par)
        if cfg.vision_config is None:
            raise ValueError(f"{type(self).__name__}: the config has no vision_config")
        self.vision_spec = VisionSpec.from_hf(cfg.vision_config, self.qwen2_5)
        if self.vision_spec.out_dim != cfg.hidden_size:
            raise ValueError(f"the vision tower's output size {self.vision_spec.out_dim} is not the language "
                             f"model's hidden size {cfg.hidden_size}")
        self.visual = Qwen2VisionTransformer(self.vision_spec) if self.is_first_stage else None

    def tokens_per_image(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.vision_spec.merge_size ** 2

    def positions(self, token_ids: Sequence[int], grids: Sequence[tuple[int, int, int]]) -> MRopePositions:
        return mrope_positions(token_ids, grids, self.config.image_token_id, self.vision_spec.merge_size)

    def encode(self, patches: Sequence[torch.Tensor], grids: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Images' patch rows (each (t h w, C T P P)) -> their language-model rows (each (t h w / merge^2, hidden)),
        all images in one pass of the vision tower (attention stays within each image)."""
        rows = self.visual(torch.cat(list(patches)), list(grids))
        return list(rows.split([self.tokens_per_image(g) for g in grids]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                stage_input: StageHidden | None = None, embed_rows: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor | StageHidden:
        """As CausalLM.forward, positions (T,) or M-RoPE's (3, T); rows `embed_rows` of the step's tokens (image
        placeholders) take `embeds` (K, hidden) instead of their token embeddings."""
        if embed_rows is not None and stage_input is None:
            x = self.embed_tokens(input_ids)
            x.index_copy_(0, embed_rows, embeds.to(x.dtype))
            stage_input = StageHidden(x, None)
        return super().forward(input_ids, positions, keep_rows, stage_input)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: the language model's under "model." (transformers >= 5 in memory: "model.language_model."),
        the vision tower's under "visual." ("model.visual.")."""
        visual, filled = self.visual, set()

        def language():
            for name, tensor in weights:
                short = name.removeprefix("model.")
                if short.startswith("visual."):
                    if visual is not None:
                        filled.update(visual.load_weights([(short.removeprefix("visual."), tensor)]))
                    continue
                yield name.replace("model.language_model.", "model."), tensor

        self.visual = None  # the decoder's loader checks every parameter it sees: the tower's are checked here
        try:
            super().load_weights(language())
        finally:
            self.visual = visual
        if visual is not None:
            missing = {n for n, _ in visual.named_parameters()} - filled
            if missing:
                raise ValueError(f"checkpoint is missing vision tensors: {sorted(missing)[:8]}")


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 - the HF class name
    """Qwen2.5-VL: the same language model; the vision tower with window attention, RMSNorm and gated MLPs."""

    qwen2_5 = True
