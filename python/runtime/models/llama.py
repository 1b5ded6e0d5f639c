"""Llama family (SmolLM2, Llama 2/3, TinyLlama, Mistral without sliding window); Qwen2/3 build on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from radixgen.runtime import distributed
from radixgen.runtime.config import ModelConfig
from radixgen.runtime.layers.activation import SiluAndMul
from radixgen.runtime.layers.attention import Attention
from radixgen.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixgen.runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.layers.rotary import RotaryEmbedding


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias)
        heads = self.qkv_proj.heads  # this tensor-parallel rank's query heads and the KV heads they read
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        in_range=(heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim))
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Qwen3 normalizes each head here

    def forward(self, positions: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (K, hidden) for rows `keep` only (every row's K/V still stored)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary(positions, q, k)
        if keep is None:
            o = self.attn(q, k, v)  # (T, H, D)
        else:
            o = self.attn.forward_rows(q.index_select(0, keep), k, v)  # (K, H, D)
        return self.o_proj(o.reshape(o.shape[0], q_size))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_id, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, keep: torch.Tensor | None = None):
        """With `keep`, the layer's outputs (and residual) are those rows only: what follows the attention is
        computed for them alone (the model's last layer, when only some rows become logits)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class StageHidden(NamedTuple):
    """What a pipeline stage hands the next: its last layer's output and the residual stream, (T, hidden) each."""

    hidden: torch.Tensor
    residual: torch.Tensor


class OtherStageLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: no parameters, never called."""


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    # checkpoint projection name -> (our merged parameter, shard id)
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        par = distributed.state()
        # this pipeline stage's layers; the others are empty placeholders, so that names keep their indices
        self.start_layer, self.end_layer = distributed.layer_range(cfg.num_layers, par.pp_size, par.pp_rank)
        self.is_first_stage, self.is_last_stage = par.is_first_stage, par.is_last_stage
        self.embed_tokens = None  # the first stage's (a tied LM head on another stage holds its own copy)
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # one rotary table shared by all layers
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # a layer's id is its index in this stage's KV pool
        self.layers = nn.ModuleList([
            self.layer_cls(cfg, i - self.start_layer, rotary) if self.start_layer <= i < self.end_layer
            else OtherStageLayer() for i in range(cfg.num_layers)])
        self.norm = self.lm_head = None  # the last stage's
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.tie(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep_rows: torch.Tensor | None = None,
                stage_input: StageHidden | None = None) -> torch.Tensor | StageHidden:
        """(T,) ids and positions -> (T, hidden) final hidden states, or (K, hidden) for rows `keep_rows` only:
        the last layer then runs its attention output, MLP and the final norm for those rows alone, the rest
        of the last layer being needed by no one (K/V go through the forward context either way).

        Pipeline stages: a stage after the first starts from the previous one's `stage_input` instead of the
        ids' embeddings, and a stage before the last returns its last layer's StageHidden."""
        if stage_input is None:
            x, residual = self.embed_tokens(input_ids), None
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

    def on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without "model.") belongs to another pipeline stage."""
        if name.startswith("layers."):
            return isinstance(self.layers[int(name.split(".", 2)[1])], OtherStageLayer)
        if name.startswith("embed_tokens."):
            return self.embed_tokens is None
        return name.startswith(("norm.", "lm_head.")) and not self.is_last_stage

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        tied = self.config.tie_word_embeddings
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
            shard = None
            for ckpt, (ours, shard_id) in self.stacked.items():
                if f".{ckpt}." in name:
                    name, shard = name.replace(f".{ckpt}.", f".{ours}."), shard_id
                    break
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
