"""BERT / XLM-RoBERTa encoders (BGE, E5, cross-encoder rerankers): bidirectional attention, absolute position
embeddings, token types, post-LayerNorm blocks. One sequence per call, no KV cache: the pooling stage runs it per
request (scheduler/encoder.py); the hidden states are pooled there, or a classification head scores them.

Weights by their Hugging Face names (`bert.` / `roberta.` prefixes of the *ForSequenceClassification classes
dropped)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleDict({n: nn.Linear(hidden, hidden) for n in ("query", "key", "value")})
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        # (H, T, D) per projection; every token attends to every token
        q, k, v = (self.qkv[n](x).view(t, self.heads, h // self.heads).transpose(0, 1) for n in ("query", "key",
                                                                                                  "value"))
        a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(t, h)
        x = self.attn_norm(x + self.attn_out(a))  # post-LN
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


_LAYER_NAMES = {  # HF name within encoder.layer.{i} -> ours
    "attention.self.query": "qkv.query", "attention.self.key": "qkv.key", "attention.self.value": "qkv.value",
    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm",
}


class BertEncoder(nn.Module):
    """Embeddings and encoder layers; `classify` applies the sequence classification head (when the checkpoint
    has one: BERT's pooler + classifier, RoBERTa's dense + out_proj over the first token)."""

    def __init__(self, hf: dict, family: str, classifier: bool) -> None:
        super().__init__()
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (gelu only)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported")
        hidden, eps = hf["hidden_size"], hf.get("layer_norm_eps", 1e-12)
        self.family = family
        self.max_positions = hf["max_position_embeddings"]
        # XLM-R numbers positions from padding_idx + 1 (its position table's first rows are never used)
        self.position_offset = hf.get("pad_token_id", 1) + 1 if family == "xlm-roberta" else 0
        self.word = nn.Embedding(hf["vocab_size"], hidden)
        self.position = nn.Embedding(self.max_positions, hidden)
        self.token_type = nn.Embedding(hf.get("type_vocab_size", 2), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(_Layer(hidden, hf["num_attention_heads"], hf["intermediate_size"], eps)
                                    for _ in range(hf["num_hidden_layers"]))
        self.num_labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 1) if classifier else 0
        self.head = None
        if classifier:
            self.head = nn.ModuleDict({"dense": nn.Linear(hidden, hidden), "out": nn.Linear(hidden, self.num_labels)})

    @property
    def max_tokens(self) -> int:
        return self.max_positions - self.position_offset

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids and token types -> (T, hidden) last hidden states."""
        t = input_ids.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed the encoder's {self.max_tokens} positions")
        positions = torch.arange(self.position_offset, self.position_offset + t, device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_labels,) logits of the sequence from its first token's hidden state."""
        return self.head["out"](torch.tanh(self.head["dense"](hidden[0])))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for ckpt_name, tensor in weights:
            name = _our_name(ckpt_name)
            if name is None or (name.startswith("head.") and self.head is None):
                continue  # BERT's pooler in an embedding model: not used
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in the encoder")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {ckpt_name}: {tuple(p.shape)} vs {tuple(tensor.shape)}")
            with torch.no_grad():
                p.copy_(tensor.read() if hasattr(tensor, "read") else tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8]}")


def _our_name(ckpt: str) -> str | None:
    """Our parameter name of checkpoint tensor `ckpt`; None for tensors the encoder does not use."""
    for prefix in ("bert.", "roberta."):
        ckpt = ckpt.removeprefix(prefix)
    if ckpt.startswith("embeddings."):
        rest = ckpt.removeprefix("embeddings.")
        table = {"word_embeddings": "word", "position_embeddings": "position",
                 "token_type_embeddings": "token_type", "LayerNorm": "embed_norm"}
        part, _, leaf = rest.rpartition(".")
        return f"{table[part]}.{leaf}" if part in table else None  # position_ids buffers
    if ckpt.startswith("encoder.layer."):
        _, _, i, rest = ckpt.split(".", 3)
        part, _, leaf = rest.rpartition(".")
        return f"layers.{i}.{_LAYER_NAMES[part]}.{leaf}" if part in _LAYER_NAMES else None
    # BERT's head: pooler.dense then classifier; RoBERTa's: classifier.dense then classifier.out_proj
    head = {"pooler.dense": "head.dense", "classifier": "head.out", "classifier.dense": "head.dense",
            "classifier.out_proj": "head.out"}
    part, _, leaf = ckpt.rpartition(".")
    return f"{head[part]}.{leaf}" if part in head else None
