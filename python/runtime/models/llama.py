"""Llama family (SmolLM2, Llama 2/3, TinyLlama, Mistral without sliding window); Qwen2/3 build on it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.layers.activation import SiluAndMul
from radixgen.runtime.layers.attention import Attention
from radixgen.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixgen.runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPInfo,
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
        self.num_heads = cfg.num_heads // TPInfo.size
        self.num_kv_heads = max(1, cfg.num_kv_heads // TPInfo.size)
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
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


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    # checkpoint projection name -> (our merged parameter, shard id)
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # one rotary table shared by all layers
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([self.layer_cls(cfg, i, rotary) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) ids and positions -> (T, hidden) final hidden states, or (K, hidden) for rows `keep_rows` only:
        the last layer then runs its attention output, MLP and the final norm for those rows alone, the rest
        of the last layer being needed by no one (K/V go through the forward context either way)."""
        x, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, keep_rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
            if name == "embed_tokens.weight" and tied:  # the head holds the shared weight (ParallelLMHead.tie)
                name = "lm_head.weight"
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
                if param.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: {tuple(param.shape)} vs {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            else:
                try:
                    loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} (into {name}): {e}") from e
            loaded.add(name)
        missing = {n for n, p in params.items() if n not in loaded and not getattr(p, "optional", False)}
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
