"""A decoder-only causal LM assembled from a declared `Architecture`: its attention variant and rotary, its MLP
part, its weight mapping (models/parts.py, models/weights.py). An architecture's file declares one and a
`CausalLM` subclass naming it; the registry (models/__init__.py) maps the config's `architectures` entry to it.

The model is this rank's part: its pipeline stage's layers (the others are parameterless placeholders, so names
keep their indices), its tensor-parallel shards, built over the ParallelContext it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground import sharding
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.models.parts import AttentionSpec, DecoderLayer, GatedMLP, LayerStructure
from radixgen.runtime.models.weights import WeightMapping


@dataclass(frozen=True)
class Architecture:
    """An architecture's declaration. attention: its variant and rotary; mlp: the MLP part's class, built as
    mlp(cfg, par, layer_id) (models.parts.MLPPart); weights: its checkpoint and GGUF names; gguf_arch: the
    general.architecture of its GGUF files (None: none are read)."""

    name: str
    attention: AttentionSpec
    weights: WeightMapping
    mlp: type = GatedMLP
    gguf_arch: str | None = None


class StageHidden(NamedTuple):
    """What a pipeline stage hands the next: its last layer's output and the residual stream, (T, hidden) each."""

    hidden: torch.Tensor
    residual: torch.Tensor


class OtherStageLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: no parameters, never called."""


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head, of `architecture` (set by each subclass)."""

    architecture: Architecture

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel = cfg, par
        arch = self.architecture
        # this pipeline stage's layers; the others are empty placeholders, so that names keep their indices
        self.start_layer, self.end_layer = sharding.layer_range(cfg.num_layers, par.pp_size, par.pp_rank)
        self.is_first_stage, self.is_last_stage = par.is_first_stage, par.is_last_stage
        self.embed_tokens = None  # the first stage's (a tied LM head on another stage holds its own copy)
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=par.tp)
        self.rotary = arch.attention.rotary(cfg)  # one rotary table shared by all layers
        self.layers = nn.ModuleList([self.make_layer(i) if self.start_layer <= i < self.end_layer else OtherStageLayer()
                                     for i in range(cfg.num_layers)])
        self.norm = self.lm_head = None  # the last stage's
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=par.tp)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.tie(self.embed_tokens)

    def make_layer(self, i: int) -> nn.Module:
        """Decoder layer `i` of the model (an architecture whose layers differ overrides it); its id in this
        stage's KV pool is i - start_layer."""
        arch = self.architecture
        return DecoderLayer(self.config, self.parallel, i - self.start_layer, arch.attention, arch.mlp, self.rotary,
                            index=i)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) the first layer's input."""
        return self.embed_tokens(input_ids)

    def unfused(self) -> str | None:
        """Why the fused CPU decode step and CUDA graphs must not run this model, in words (None: they may):
        what its layers say of themselves (an attention variant), or what the model adds around them."""
        for i in range(self.start_layer, self.end_layer):
            variant = self.layers[i].structure().attention.variant
            if variant is not None:
                return f"layer {i}'s attention has {variant}"
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                stage_input: StageHidden | None = None) -> torch.Tensor | StageHidden:
        """(T,) ids and positions -> (T, hidden) final hidden states, or (K, hidden) for rows `keep_rows` only:
        the last layer then runs its attention output, MLP and the final norm for those rows alone, the rest
        of the last layer being needed by no one (K/V go through the forward context either way).

        Pipeline stages: a stage after the first starts from the previous one's `stage_input` instead of the
        ids' embeddings, and a stage before the last returns its last layer's StageHidden."""
        if stage_input is None:
            x, residual = self.embed(input_ids), None
        else:
            x, residual = stage_input
        last = len(self.layers) - 1
        for i in range(self.start_layer, self.end_layer):
            x, residual = self.layers[i](positions, x, residual, keep_rows if i == last else None)
        if not self.is_last_stage:
            return StageHidden(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of this tensor-parallel rank's vocabulary rows (T, rows)."""
        return self.lm_head(hidden).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits (T, vocab) on the stage's first tensor-parallel rank (None on the others)."""
        return self.lm_head.gather(self.local_logits(hidden))

    def decoder_structure(self) -> list[LayerStructure]:
        """This stage's decoder layers as the fused paths read them (models.parts.LayerStructure), in order."""
        return [self.layers[i].structure() for i in range(self.start_layer, self.end_layer)]

    def on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without "model.") belongs to another pipeline stage."""
        if name.startswith("layers."):
            return isinstance(self.layers[int(name.split(".", 2)[1])], OtherStageLayer)
        if name.startswith("embed_tokens."):
            return self.embed_tokens is None
        return name.startswith(("norm.", "lm_head.")) and not self.is_last_stage

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors (HF names) into this rank's parameters, through the architecture's mapping; every
        parameter (but optional ones) must be filled, and every tensor of this rank must have a parameter."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        tied = self.config.tie_word_embeddings
        mapping = self.architecture.weights
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            name = ckpt_name.removeprefix("model.")
            if name == "lm_head.weight" and tied:
                continue
            if name == "embed_tokens.weight" and tied and self.lm_head is not None:
                name = "lm_head.weight"  # the head holds the shared weight (ParallelLMHead.tie)
            if self.on_other_stage(name):
                continue  # never read
            name, shard = mapping.parameter(name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: {tuple(param.shape)} vs {tuple(tensor.shape)}")
                param.data.copy_(tensor.narrow(0, 0, tensor.shape[0]))  # a CheckpointSlice reads it here
            else:
                try:
                    loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} (into {name}): {e}") from e
            loaded.add(name)
        missing = {n for n, p in params.items() if n not in loaded and not getattr(p, "optional", False)}
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
