"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector, a Llama / Qwen2 / Mistral
language model. The image's features are the hidden states of the tower's layer `vision_feature_layer` (a list
of layers: their features side by side), without the class token under the "default" select strategy ("full"
keeps it); the projector maps each patch's feature to one embedding of the language model. Positions are the
plain 1-D ones (models/multimodal.py's default hook); the front end is runtime/media/llava.py.

Checkpoint names: Hugging Face's legacy layout (vision_tower.*, multi_modal_projector.*, language_model.model.*,
language_model.lm_head.*) and the newer one (model.vision_tower.*, model.multi_modal_projector.*,
model.language_model.*, lm_head.*); the tower's own "vision_model." level is optional.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.layers.linear import ColumnParallelLinear
from radixgen.runtime.models.clip import CLIPVisionTower, activation
from radixgen.runtime.models.multimodal import VisionLanguageLM


def feature_layers(hf: dict) -> list[int]:
    layers = hf.get("vision_feature_layer", -2)
    return list(layers) if isinstance(layers, (list, tuple)) else [layers]


def layers_needed(hf: dict) -> int:
    """How many tower layers the features read: hidden state i (0: embeddings) is the output of layer i."""
    total = hf["vision_config"]["num_hidden_layers"]
    idx = [i if i >= 0 else total + 1 + i for i in feature_layers(hf)]
    if not all(0 <= i <= total for i in idx):
        raise ValueError(f"vision_feature_layer {hf.get('vision_feature_layer')} is outside the tower's {total} layers")
    return max(idx)


class LlavaProjector(nn.Module):
    def __init__(self, vision_in: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_in, text_hidden, bias=bias)
        self.linear_2 = ColumnParallelLinear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, vision_in) -> (rows, text_hidden)
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageLM):
    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, par)
        hf = self.hf_config
        vc = hf["vision_config"]
        self.strategy = hf.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r} (default, full)")
        self.feature_layers = feature_layers(hf)
        total = vc["num_hidden_layers"]
        self.feature_index = [i if i >= 0 else total + 1 + i for i in self.feature_layers]
        self.vision_tower = CLIPVisionTower(vc, layers_needed(hf))
        self.multi_modal_projector = LlavaProjector(
            vc["hidden_size"] * len(self.feature_layers), cfg.hidden_size, hf.get("projector_hidden_act", "gelu"),
            bool(hf.get("multimodal_projector_bias", True)))

    def encode(self, items: list) -> list[torch.Tensor]:
        """Every item's pixels through the tower in one batch (LLaVA's images all have the tower's size)."""
        if not items:
            return []
        pixels = torch.stack([it.pixel_values for it in items]).to(self.vision_tower.class_embedding.device)
        states = self.vision_tower(pixels)
        feats = [states[i] for i in self.feature_index]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]  # without the class token
        x = torch.cat(feats, dim=-1)  # (B, N, vision_hidden * layers)
        b, n, d = x.shape
        out = self.multi_modal_projector(x.reshape(b * n, d)).view(b, n, -1)
        for it, o in zip(items, out, strict=True):
            if o.shape[0] != it.num_tokens:
                raise ValueError(f"the image gives {o.shape[0]} embeddings, its prompt span has {it.num_tokens}")
        return list(out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tower's and projector's tensors here; the language model's through its own loader (as "model.*" /
        "lm_head.*"), which checks that each of its parameters is filled."""
        tower, projector = set(), set()  # our parameter names filled

        def language():
            for name, tensor in weights:
                n = name.removeprefix("model.")
                if n.startswith("vision_tower."):
                    n = n.removeprefix("vision_tower.").removeprefix("vision_model.")
                    if self.vision_tower.load(n, tensor):
                        tower.add(_our_name(n))
                elif n.startswith("multi_modal_projector."):
                    n = n.removeprefix("multi_modal_projector.")
                    param = dict(self.multi_modal_projector.named_parameters()).get(n)
                    if param is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no matching projector parameter")
                    param.weight_loader(param, tensor)
                    projector.add(n)
                elif n.startswith("language_model."):
                    n = n.removeprefix("language_model.")
                    yield (n if n.startswith(("model.", "lm_head.")) else f"model.{n}"), tensor
                elif name.startswith("lm_head."):
                    yield name, tensor
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")

        self.language_model.load_weights(language())
        missing = sorted({n for n, _ in self.vision_tower.named_parameters()} - tower)
        missing += sorted({n for n, _ in self.multi_modal_projector.named_parameters()} - projector)
        if missing:
            raise ValueError(f"checkpoint is missing vision tensors: {missing[:8]}")


def _our_name(ckpt: str) -> str:
    """The tower parameter a checkpoint tensor filled (q / k / v go into the merged qkv_proj)."""
    n = ckpt.removeprefix("embeddings.")
    for proj in ("q_proj", "k_proj", "v_proj"):
        n = n.replace(f"self_attn.{proj}.", "self_attn.qkv_proj.")
    n = n.replace("position_embedding.weight", "position_embedding")
    return n.replace(".mlp.", ".").replace("encoder.layers.", "layers.")
