"""The parts a decoder architecture is declared from (models/decoder.py assembles them): the attention block with
its variants, its rotary (a replaceable component), the MLP slot and its dense gated MLP, the norm, and the
records each part describes itself with (`structure()`), which the fused CPU decode step and the CUDA graph
runner read instead of inspecting the model's classes.

Every part is built as part(cfg, par, layer_id): `par` the model's ParallelContext, whose axes the part hands to
its layers (nothing reads a global while built).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.ground.sharding import head_shard
from radixgen.runtime.layers.activation import SiluAndMul
from radixgen.runtime.layers.attention import Attention
from radixgen.runtime.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixgen.runtime.layers.masked_attention import AttentionVariant
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.layers.rotary import ROPE, RotaryEmbedding, RotaryStructure  # noqa: F401 (ROPE)

# MLP kinds (MLPStructure.kind): what the fused decode step and the CUDA graphs know how to run
DENSE_GATED_SILU = "dense_gated_silu"  # down(silu(gate(x)) * up(x)), gate and up in one matmul
MOE_GATED_SILU = "moe_gated_silu"  # routed experts, each a gated SiLU MLP; MLPStructure.moe describes them


# ---------------------------------------------------------------- what the parts describe


class AttentionStructure(NamedTuple):
    """This rank's attention: the fused qkv and o projections, the q/k/v bias (the qkv layer's), per-head q / k
    RMSNorm weights (None: none), its heads, softmax scale and rotary."""

    qkv: LinearBase
    o: LinearBase
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotaryStructure
    variant: str | None = None  # what makes it other than plain causal GQA (DecoderAttention.variant); None: plain


class MoEStructure(NamedTuple):
    """An expert block (MOE_GATED_SILU) on this rank: its routing (layers.moe.MoERouting), the router's (E, hidden)
    weight over all experts, this rank's experts as GroupedLinears gate_up (E_local, 2I, hidden; gate rows first)
    and down (E_local, hidden, I) holding global experts [first_expert, first_expert + E_local), the shared expert
    (Qwen2-MoE) as its dense (gate_up, down) linears or None, and the shared expert's sigmoid gate weight (1,
    hidden) or None. The block's output is this rank's partial sum, all-reduced over the tp axis by the part."""

    routing: object  # layers.moe.MoERouting
    router: torch.Tensor
    gate_up: object  # layers.quantization.experts.GroupedLinear
    down: object
    shared: tuple[LinearBase, LinearBase] | None
    shared_gate: torch.Tensor | None
    first_expert: int = 0


class MLPStructure(NamedTuple):
    """The MLP slot's part: its kind, its linear layers by role (DENSE_GATED_SILU: "gate_up", "down"), this rank's
    intermediate size, and whether a step through it is safe to capture in a CUDA graph (no host sync, no
    data-dependent shapes: an expert block's routing is neither); `moe`, an expert block's description."""

    kind: str
    linears: dict[str, LinearBase]
    intermediate: int
    graph_safe: bool
    moe: MoEStructure | None = None


class LayerStructure(NamedTuple):
    """A decoder layer: RMSNorm weights before the attention and before the MLP, eps, and its two blocks."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    attention: AttentionStructure
    mlp: MLPStructure


# ---------------------------------------------------------------- attention


def rope(cfg: ModelConfig) -> RotaryEmbedding:
    """The default rotary: rotate-half with the config's theta and (Llama 3) scaling."""
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


@dataclass(frozen=True)
class AttentionSpec:
    """The attention's variant: a bias on q, k, v (Qwen2's; also where the config asks for it: attention_bias),
    an RMSNorm over each query and key head before the rotation (Qwen3's), and the rotary, built once per model
    from the config and shared by its layers (a module with forward(positions, q, k) -> (q, k) and structure();
    M-RoPE stands in here)."""

    qkv_bias: bool = False
    qk_norm: bool = False
    rotary: object = rope  # (cfg) -> the rotary module
    # the variants (layers/masked_attention.py; the config's sliding windows apply to every spec): a learned sink
    # logit per query head (gpt-oss), the q / k norm's class (Gemma 3's (1 + w)), a bias on o_proj (gpt-oss),
    # the softmax scale and the logit soft-cap as functions of the config (None: head_dim ** -0.5; none)
    sinks: bool = False
    norm: type = RMSNorm
    o_bias: bool = False
    scale: object = None
    softcap: object = None


def _head_features(cfg: ModelConfig, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """o_proj's input features on a rank of `tp_size`: its query heads' (start, size)."""
    heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp_size, tp_rank)
    return heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim


class DecoderAttention(nn.Module):
    """Grouped-query attention over this rank's heads: qkv_proj, [q_norm, k_norm], rotary, paged attention, o_proj."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int, spec: AttentionSpec,
                 rotary: nn.Module | None, index: int | None = None) -> None:
        """layer_id: the layer's index in this stage's KV pool; index: in the model (its sliding window)."""
        super().__init__()
        tp = par.tp
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=spec.qkv_bias or cfg.attention_bias, tp=tp)
        heads = self.qkv_proj.heads  # this tensor-parallel rank's query heads and the KV heads they read
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=spec.o_bias, tp=tp,
                                        shares=partial(_head_features, cfg))
        self.rotary = rotary  # None: a layer without positions (SmolLM3's no_rope_layers)
        self.sinks = None
        if spec.sinks:  # this rank's query heads' sink logits
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = partial(_head_rows, heads.q_start, self.num_heads)
        window = cfg.window(layer_id if index is None else index)
        variant = AttentionVariant(window, spec.softcap(cfg) if spec.softcap else None, self.sinks)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id,
                              spec.scale(cfg) if spec.scale else None, variant)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = spec.norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = spec.norm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (K, hidden) for rows `keep` only (every row's K/V still stored)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if keep is None:
            o = self.attn(q, k, v)  # (T, H, D)
        elif self.attn.variant is not None:  # the masked path computes every row
            o = self.attn(q, k, v).index_select(0, keep)
        else:
            o = self.attn.forward_rows(q.index_select(0, keep), k, v)  # (K, H, D)
        return self.o_proj(o.reshape(o.shape[0], q_size))

    def structure(self) -> AttentionStructure:
        rotary = self.rotary.structure() if hasattr(self.rotary, "structure") else RotaryStructure(
            "none" if self.rotary is None else "?", None)
        return AttentionStructure(
            self.qkv_proj, self.o_proj, self.qkv_proj.bias, None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight, self.num_heads, self.num_kv_heads, self.head_dim,
            self.attn.scale, rotary, variant=self.variant())

    def variant(self) -> str | None:
        """What the fused paths do not run in this attention, in words (None: nothing)."""
        extra = [] if self.attn.variant is None else [self.attn.variant.describe()]
        if self.o_proj.bias is not None:
            extra.append("a bias on o_proj")
        if self.q_norm is not None and type(self.q_norm) is not RMSNorm:
            extra.append(f"{type(self.q_norm).__name__} q / k norms")
        return ", ".join(extra) or None


def _head_rows(start: int, size: int, param: nn.Parameter, loaded, shard_id=None) -> None:
    """A per-query-head tensor (H,): this rank's heads [start, start + size)."""
    loaded = loaded if isinstance(loaded, torch.Tensor) else loaded.read()
    param.data.copy_(loaded.narrow(0, start, size))


# ---------------------------------------------------------------- the MLP slot


class MLPPart(nn.Module):
    """What the decoder layer calls after the attention: forward((T, hidden) normed rows) -> (T, hidden), this
    rank's partial sums already reduced over its axis; built as part(cfg, par, layer_id). `structure()` says what
    it is to the fused paths: a kind they do not know (an expert block) sends a step to the layer-by-layer path."""

    def structure(self) -> MLPStructure:
        raise NotImplementedError


class GatedMLP(MLPPart):
    """The dense gated MLP: down(silu(gate(x)) * up(x)), gate and up in one column-parallel matmul."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp=par.tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=par.tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def structure(self) -> MLPStructure:
        return MLPStructure(DENSE_GATED_SILU, {"gate_up": self.gate_up_proj, "down": self.down_proj},
                            self.down_proj.in_features, graph_safe=True)


# ---------------------------------------------------------------- the layer


class DecoderLayer(nn.Module):
    """Pre-norm residual block: RMSNorm -> attention -> (+residual) RMSNorm -> MLP part."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int, attention: AttentionSpec,
                 mlp, rotary: nn.Module | None, index: int | None = None) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, par, layer_id, attention, rotary, index)
        self.mlp = mlp(cfg, par, layer_id)
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

    def structure(self) -> LayerStructure:
        return LayerStructure(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                              self.input_layernorm.eps, self.self_attn.structure(), self.mlp.structure())
