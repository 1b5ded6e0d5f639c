"""Vision-language models: a vision encoder whose outputs stand in for the placeholder rows of a CausalLM.

The model's side of the image contract (the front end's side is runtime/media/processor.py):

- **The class.** A `VisionLanguageLM` subclass holds `language_model`, a CausalLM of its text config's
  architecture (built over the paged KV pool as any text model: the fused CPU decode step, CUDA graphs and the
  pool sizing read it), plus its vision parts. It is built as cls(cfg, par) like a CausalLM: `cfg` is the
  ModelConfig of the text model (`cfg.architecture` the multimodal key, `cfg.text_architecture` the language
  model's), and `cfg.multimodal` the whole Hugging Face config (vision_config, projector fields, token ids).
  Register it in runtime/architectures.py and its processor in runtime/media/processor.PROCESSORS.
- **encode(items) -> list of (num_tokens, hidden) tensors**, one per `ProcessedImage`, in the model's dtype on
  its device: the vision tower and projector, batched over the items of one step (the runner calls it once per
  step with every item the step needs that the encoder cache (executor/encoder_cache.py) does not hold).
- **positions(positions, step) -> the position ids the rotary takes**: `positions` (T,) are the plain ones (the
  row's index in its sequence); `step` a `StepMedia`. The default returns them unchanged (LLaVA). A model with
  its own positions (Qwen2-VL's M-RoPE) returns (3, T) for a step with image rows, computed from each request's
  items (their grids and spans), and for a decode step (T,) positions offset by each request's delta (text after
  the images, where the three sections agree), so that decode steps still take the fused CPU step and CUDA
  graphs. It is called for every step in which some request has media, decode steps included.
- **forward(input_ids, positions, keep_rows=None, stage_input=None, media=None)**: `media` a `MediaEmbeds`
  (the step's rows whose embeddings come from the encoder, and those embeddings); the token embeddings of the
  other rows, then the language model's layers. Without `media` it is the language model's forward.

What the runner does each step (executor/model_runner.py): a `ForwardInput.media` (set by the scheduler's
Batch when some request of the step has media) gives each request's `MediaItem`s (its whole prompt's, spans
in prompt positions). `StepMedia.pieces()` lists, for each item overlapping the step's rows [prefix, prefix +
extend) of its request, which step rows take which rows of its embedding: chunked prefill may cut an image
anywhere, and a cache hit may end inside a span; a row always takes row (position - item.start) of its item's
embedding, so any cut is exact. The runner gets each needed item's embedding from the encoder cache (by
content hash) or encodes the missing ones in one `encode` call, gathers the rows into a `MediaEmbeds`, and
calls `positions` then `forward`.

Refused at start with a multimodal model (executor/model_runner.check_multimodal names the combination): tensor /
pipeline parallelism (a step's embeddings would have to reach every rank), a draft model (it has no vision
tower), LoRA adapters. Constraints, n-gram speculation (drafts stop before a media span) and the radix cache work.
Steps with image rows run the layer-by-layer path (neither the fused CPU decode step nor CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from radixgen.common.prompt import MediaItem
from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.models.decoder import StageHidden


class MediaPiece(NamedTuple):
    """Step rows [row, row + (hi - lo)) take rows [lo, hi) of the embedding of media item `item` of request `req`."""

    req: int
    item: int
    row: int
    lo: int
    hi: int


class StepMedia(NamedTuple):
    """One step's media, per request in the step's order: its rows [prefix, prefix + extend) and its items."""

    prefix_lens: list[int]
    extend_lens: list[int]
    items: tuple[tuple[MediaItem, ...], ...]

    def pieces(self) -> Iterator[MediaPiece]:
        row = 0  # the step row of request b's first new token
        for b, (p, e, items) in enumerate(zip(self.prefix_lens, self.extend_lens, self.items, strict=True)):
            for k, it in enumerate(items):
                lo, hi = max(it.start, p), min(it.end, p + e)  # prompt positions of the span computed now
                if lo < hi:
                    yield MediaPiece(b, k, row + lo - p, lo - it.start, hi - it.start)
            row += e


class MediaEmbeds(NamedTuple):
    """The step rows (M,) whose input embeddings are `values` (M, hidden) instead of their tokens'."""

    rows: torch.Tensor
    values: torch.Tensor


class VisionLanguageLM(nn.Module):
    """A vision encoder over a CausalLM (see the module docstring); subclasses build `self.vision` parts and
    implement `encode` and `load_weights`."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__()
        from radixgen.runtime.models import model_class

        if par.world_size > 1:
            raise ValueError(f"{cfg.architecture}: a vision-language model runs on one rank (tp_size and pp_size 1)")
        self.config, self.parallel = cfg, par
        self.hf_config = cfg.multimodal or {}
        text_cfg = replace(cfg, architecture=cfg.text_architecture, multimodal=None, text_architecture=None)
        self.language_model = model_class(cfg.text_architecture)(text_cfg, par)

    # ---- what the runner, the fused decode step and the CUDA graphs read: the language model's
    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def start_layer(self) -> int:
        return self.language_model.start_layer

    @property
    def end_layer(self) -> int:
        return self.language_model.end_layer

    @property
    def is_first_stage(self) -> bool:
        return self.language_model.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.language_model.is_last_stage

    @property
    def embed_tokens(self):
        return self.language_model.embed_tokens

    @property
    def norm(self):
        return self.language_model.norm

    @property
    def lm_head(self):
        return self.language_model.lm_head

    def decoder_structure(self):
        return self.language_model.decoder_structure()

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.local_logits(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    # ---- the contract
    def encode(self, items: list) -> list[torch.Tensor]:
        """ProcessedImages -> their embeddings, (num_tokens, hidden) each."""
        raise NotImplementedError

    def positions(self, positions: torch.Tensor, step: StepMedia) -> torch.Tensor:
        return positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                stage_input: StageHidden | None = None, media: MediaEmbeds | None = None):
        if media is not None and stage_input is None:
            x = self.language_model.embed_tokens(input_ids)  # (T, hidden)
            x = x.index_copy(0, media.rows, media.values.to(x.dtype))
            stage_input = StageHidden(x, None)  # the first layer takes embedded rows as the first stage would
        return self.language_model(input_ids, positions, keep_rows=keep_rows, stage_input=stage_input)
