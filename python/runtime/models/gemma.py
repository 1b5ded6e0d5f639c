"""Gemma 2 and Gemma 3 (text): the decoder parts with sandwich norms (a norm after the attention and after the
MLP as well as before each), RMSNorms that scale by (1 + w), embeddings scaled by sqrt(hidden), a gated GELU
(tanh) MLP, the softmax scale from query_pre_attn_scalar, local sliding-window layers among global ones
(config.layer_types), logit soft-capping (Gemma 2: on the attention logits and the final logits). Gemma 3 adds an
RMSNorm over each query and key head and a rotary base per layer kind (local 10k, global 1M with its scaling)."""

from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig, rope_of
from radixgen.runtime.ground.parallel_context import SINGLE, ParallelContext
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.layers.rotary import RotaryEmbedding
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.parts import AttentionSpec, DecoderLayer, GatedMLP, MLPStructure
from radixgen.runtime.models.weights import (
    ATTENTION_WEIGHTS,
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    QK_NORM_WEIGHTS,
    WeightMapping,
)

DENSE_GATED_GELU_TANH = "dense_gated_gelu_tanh"  # an MLP kind the fused paths do not run


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w). The checkpoint's w is loaded as 1 + w, so the plain norm (and its
    kernels) computes it."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__(hidden, eps)
        self.weight.weight_loader = _plus_one


def _plus_one(param: nn.Parameter, loaded, shard_id=None) -> None:
    loaded = loaded if isinstance(loaded, torch.Tensor) else loaded.read()
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"norm weight shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.float() + 1.0)


class GeluTanhMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)

    def structure(self) -> MLPStructure:
        return super().structure()._replace(kind=DENSE_GATED_GELU_TANH)


class SandwichLayer(DecoderLayer):
    """norm -> attention -> norm (+residual) norm -> MLP -> norm; the residual add is deferred to the next norm as
    in DecoderLayer."""

    def __init__(self, cfg: ModelConfig, par, layer_id: int, attention: AttentionSpec, mlp, rotary,
                 index: int) -> None:
        super().__init__(cfg, par, layer_id, attention, mlp, rotary, index)
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, residual, keep: torch.Tensor | None = None):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, keep))
        if keep is not None:
            residual = residual.index_select(0, keep)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def _scale(cfg: ModelConfig) -> float:
    return float(cfg.hf.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5


def _attn_softcap(cfg: ModelConfig) -> float | None:
    return cfg.hf.get("attn_logit_softcapping")


# llama.cpp's Gemma files: the sandwich norms under their names (listed first: ffn_norm is the pre-MLP norm here);
# every norm stored as 1 + w (the loader takes the 1 off again: runtime/gguf_arch.py)
GEMMA_GGUF = WeightMapping(gguf_block=(("post_attention_norm.weight", "post_attention_layernorm.weight"),
                                       ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
                                       ("post_ffw_norm.weight", "post_feedforward_layernorm.weight")))
_GEMMA_WEIGHTS = GEMMA_GGUF + DECODER_WEIGHTS + ATTENTION_WEIGHTS + GATED_MLP_WEIGHTS

GEMMA2 = Architecture("gemma2", AttentionSpec(scale=_scale, softcap=_attn_softcap), weights=_GEMMA_WEIGHTS,
                      mlp=GeluTanhMLP, gguf_arch="gemma2")
GEMMA3 = Architecture("gemma3", AttentionSpec(qk_norm=True, norm=OffsetRMSNorm, scale=_scale, softcap=_attn_softcap),
                      weights=_GEMMA_WEIGHTS + QK_NORM_WEIGHTS, mlp=GeluTanhMLP, gguf_arch="gemma3")


class Gemma2ForCausalLM(CausalLM):
    architecture = GEMMA2

    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, par)
        if self.norm is not None:
            self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.logit_softcap = cfg.hf.get("final_logit_softcapping")

    def rotary_of(self, i: int) -> nn.Module:
        return self.rotary

    def make_layer(self, i: int) -> nn.Module:
        arch = self.architecture
        return SandwichLayer(self.config, self.parallel, i - self.start_layer, arch.attention, arch.mlp,
                             self.rotary_of(i), i)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)  # rounded to the dtype, as Gemma's

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().local_logits(hidden)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def unfused(self) -> str | None:
        return "Gemma's sandwich norms, scaled embeddings and gated GELU MLP"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architecture = GEMMA3

    def rotary_of(self, i: int) -> nn.Module:
        """The local layers' rotary (rope_local_base_freq, no scaling) or the global one (rope_theta, scaling)."""
        if not self.config.window(i):
            return self.rotary
        if getattr(self, "local_rotary", None) is None:
            hf = self.config.hf
            theta, scaling, _ = rope_of(hf, "sliding_attention")
            if "rope_local_base_freq" in hf:  # transformers 4's field
                theta, scaling = float(hf["rope_local_base_freq"]), None
            self.local_rotary = RotaryEmbedding(self.config.head_dim, self.config.max_position_embeddings, theta,
                                                scaling)
        return self.local_rotary
