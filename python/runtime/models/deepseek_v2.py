"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) and expert blocks with shared experts.

MLA: each token's K and V come from one compressed latent c = norm(W_a x) (kv_lora_rank values) and one shared
rotary key k_pe (qk_rope_head_dim values). The pool caches only [c | k_pe] per token and layer: one "KV head" of
half its width in K and the other half in V (ModelConfig.head_dim for this architecture), instead of num_heads
heads of K and V. Attention runs in the absorbed form: kv_b_proj's key rows are folded into the query
(q_lat = q_nope W_uk, so q_nope . k_nope = q_lat . c) and its value rows applied after the softmax
(o = (p . c) W_uv), so no token's per-head K / V is ever materialised. DeepSeek's rotary pairs adjacent
dimensions; q_pe and k_pe are permuted (evens, then odds) to the rotate-half layout first, the same permutation
on both, which leaves their dot products unchanged.

The expert block: softmax over the routed experts, top-k (greedy), the weights scaled by routed_scaling_factor
(renormalised only with norm_topk_prob), plus the shared experts' MLP with no gate; the first
first_k_dense_replace layers are dense. Runs with tp_size 1 (the latent attention is not split over ranks yet).

GGUF files (llama.cpp's "deepseek2"): the checkpoint's tensors under llama.cpp's names, rotary dimensions in the
checkpoint's order, the experts stacked. kv_b_proj is stored whole (attn_kv_b, older files) or split per head into
its key rows, transposed (attn_k_b: (H, rank, nope)), and its value rows (attn_v_b: (H, V, rank)); the split form
is joined back on load (`join_kv_b`). kv_b_proj is read as a matrix, so it is dequantized whatever its type."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixgen.kernels.kv_quant import gather_rows, store_rows_ref
from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.forward_context import get_forward_context
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixgen.runtime.layers.masked_attention import step_spans
from radixgen.runtime.layers.moe import MoERouting, experts_forward, route
from radixgen.runtime.layers.norm import RMSNorm
from radixgen.runtime.layers.rotary import RotaryEmbedding, RotaryStructure
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.moe_block import Experts, Router, SharedExpert, SparseMoEBlock
from radixgen.runtime.models.parts import AttentionSpec, AttentionStructure, DecoderLayer, GatedMLP, MLPPart
from radixgen.runtime.models.weights import (
    DECODER_WEIGHTS,
    GATED_MLP_WEIGHTS,
    QWEN_MOE_WEIGHTS,
    SHARED_EXPERT_WEIGHTS,
    WeightMapping,
)

LATENT_NORM_EPS = 1e-6  # the reference's q_a / kv_a norms keep their default eps whatever the config's


def _latent_rope(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.hf["qk_rope_head_dim"], cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


def _softmax_scale(cfg: ModelConfig) -> float:
    hf, scaling = cfg.hf, cfg.rope_scaling or {}
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    all_dim, factor = scaling.get("mscale_all_dim"), scaling.get("factor", 1.0)
    if all_dim and factor > 1:  # YaRN's magnitude correction, squared (it scales q and k alike)
        scale *= (0.1 * all_dim * math.log(factor) + 1.0) ** 2
    return scale


class LatentAttention(nn.Module):
    """MLA over the pool (see the module doc); parameter names are the checkpoint's."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int, rotary: nn.Module) -> None:
        super().__init__()
        if par.tp.size > 1:
            raise ValueError("DeepSeek-V2's latent attention runs with tp_size 1 (it is not split over ranks yet)")
        hf = cfg.hf
        self.layer_id, self.rotary = layer_id, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nope, self.rope_dim, self.v_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.rank = hf["kv_lora_rank"]
        qk, bias = self.nope + self.rope_dim, bool(hf.get("attention_bias", False))
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if hf.get("q_lora_rank"):
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, hf["q_lora_rank"], bias)
            self.q_a_layernorm = RMSNorm(hf["q_lora_rank"], LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(hf["q_lora_rank"], self.num_heads * qk)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, self.num_heads * qk)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, self.rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        # read as a matrix by the absorbed attention (never a linear method's re-laid-out weight)
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(self.num_heads * (self.nope + self.v_dim), self.rank),
                                             requires_grad=False)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, cfg.hidden_size, bias)
        self.scale = _softmax_scale(cfg)
        # adjacent rotary pairs -> rotate-half halves
        self.register_buffer("pairs", torch.cat([torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)]),
                             persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (K, hidden) for rows `keep` (every row's latent still stored)."""
        t, h = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe = q_pe.index_select(-1, self.pairs).contiguous()  # (T, H, R)
        k_pe = k_pe.index_select(-1, self.pairs).contiguous().view(t, 1, self.rope_dim)  # (T, 1, R)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        latent = torch.cat([c, k_pe.reshape(t, self.rope_dim)], dim=-1)  # (T, rank + R): what the pool keeps
        o = self.attend(q_nope, q_pe, latent)  # (T, H, V)
        if keep is not None:
            o = o.index_select(0, keep)
        return self.o_proj(o.reshape(o.shape[0], h * self.v_dim))

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """Stores the step's latents; each request's queries over its positions' latents -> (T, H, V)."""
        ctx = get_forward_context()
        kv = ctx.kv_pool.layer(self.layer_id)
        t, half = latent.shape[0], self.head_dim
        slots = ctx.out_slots.to(torch.int64)
        store_rows_ref(kv.k, kv.k_scales, slots, latent[:, :half].reshape(t, 1, half))
        store_rows_ref(kv.v, kv.v_scales, slots, latent[:, half:].reshape(t, 1, half))
        w = self.kv_b_proj.weight.float().view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, :self.nope], w[:, self.nope:]  # (H, N, rank), (H, V, rank)
        q_lat = torch.einsum("thn,hnr->htr", q_nope.float(), w_k)  # (H, T, rank): kv_b's key rows absorbed
        q_pe = q_pe.float().transpose(0, 1)  # (H, T, R)
        out = q_nope.new_empty(t, self.num_heads, self.v_dim)
        for span in step_spans(ctx):
            end = span.prefix_len + span.q_end - span.q_start
            rows = ctx.req_to_slot[span.table_row, :end].to(torch.int64)
            lat = torch.cat([gather_rows(kv.k, kv.k_scales, rows, torch.float32),
                             gather_rows(kv.v, kv.v_scales, rows, torch.float32)], dim=-1).view(end, -1)
            c, pe = lat.split([self.rank, self.rope_dim], dim=-1)  # (L, rank), (L, R)
            s = slice(span.q_start, span.q_end)
            logits = (q_lat[:, s] @ c.T + q_pe[:, s] @ pe.T) * self.scale  # (H, E, L)
            q_pos = torch.arange(span.prefix_len, end, device=c.device).unsqueeze(1)
            logits = logits.masked_fill(torch.arange(end, device=c.device).unsqueeze(0) > q_pos, float("-inf"))
            o_lat = torch.softmax(logits, dim=-1) @ c  # (H, E, rank)
            out[s] = torch.einsum("her,hvr->ehv", o_lat, w_v).to(out.dtype)
        return out

    def structure(self) -> AttentionStructure:
        return AttentionStructure(None, self.o_proj, None, None, None, self.num_heads, self.num_kv_heads,
                                  self.head_dim, self.scale, RotaryStructure("mla", None),
                                  variant="multi-head latent attention")


class DeepseekMoE(SparseMoEBlock):
    """Router `gate`, `experts`, `shared_expert` (the checkpoint's shared_experts: no gate)."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int) -> None:
        MLPPart.__init__(self)
        moe, hf = cfg.moe, cfg.hf
        if hf.get("topk_method", "greedy") != "greedy" and (hf.get("n_group") or 1) > 1:
            raise ValueError(f"DeepSeek-V2 routing topk_method={hf['topk_method']!r} over n_group={hf['n_group']} "
                             f"groups is not supported (greedy only: DeepSeek-V2-Lite's)")
        self.tp = par.tp
        self.routing = MoERouting(moe.num_experts, moe.top_k, softmax_before_topk=True,
                                  norm_topk_prob=moe.norm_topk_prob)
        self.gate = Router(moe.num_experts, cfg.hidden_size)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, par)
        self.shared_expert = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_intermediate_size, par)
        self.shared_expert_gate = None
        self.routed_scale = float(hf.get("routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.routing)
        out = experts_forward(x, weights * self.routed_scale, ids, self.experts.gate_up, self.experts.down,
                              first_expert=self.experts.first)
        out = self.tp.all_reduce(out)
        return out if self.shared_expert is None else out + self.shared_expert(x)


class LatentLayer(DecoderLayer):
    """The pre-norm layer around LatentAttention, with the expert block or (dense layers) the gated MLP."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int, index: int, rotary: nn.Module) -> None:
        nn.Module.__init__(self)
        self.self_attn = LatentAttention(cfg, par, layer_id, rotary)
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp = DeepseekMoE(cfg, par, layer_id) if sparse else GatedMLP(cfg, par, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_K_B, _V_B = ".self_attn.k_b_proj.weight", ".self_attn.v_b_proj.weight"  # the split kv_b_proj's halves
_LATENT_GGUF = WeightMapping(
    gguf_block=(("attn_q.weight", "self_attn.q_proj.weight"), ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
                ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
                ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
                ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"),
                ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
                ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"), ("attn_k_b.weight", _K_B.removeprefix(".")),
                ("attn_v_b.weight", _V_B.removeprefix(".")), ("attn_output.weight", "self_attn.o_proj.weight")),
    gguf_matmuls=frozenset({"attn_q.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight",
                            "attn_output.weight"}))

DEEPSEEK_V2 = Architecture(
    "deepseek_v2", AttentionSpec(rotary=_latent_rope),
    weights=DECODER_WEIGHTS + GATED_MLP_WEIGHTS + QWEN_MOE_WEIGHTS + SHARED_EXPERT_WEIGHTS + _LATENT_GGUF
    + WeightMapping(renames=((".shared_experts.", ".shared_expert."),)),
    gguf_arch="deepseek2")


def join_kv_b(weights):
    """The checkpoint's tensors with each layer's split kv_b_proj (k_b (H, rank, nope), v_b (H, V, rank)) joined
    into kv_b_proj's (H * (nope + V), rank) rows, each head's key rows then its value rows."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        kind = "k" if name.endswith(_K_B) else "v" if name.endswith(_V_B) else None
        if kind is None:
            yield name, tensor
            continue
        prefix = name.removesuffix(_K_B if kind == "k" else _V_B)
        got = halves.setdefault(prefix, {})
        got[kind] = torch.as_tensor(tensor).float()
        if len(got) == 2:
            k_b, v_b = got["k"], got["v"]
            del halves[prefix]
            if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
                raise ValueError(f"{prefix}: attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
                                 f"(heads, rank, nope) and (heads, v_head_dim, rank)")
            yield f"{prefix}.self_attn.kv_b_proj.weight", torch.cat([k_b.transpose(1, 2), v_b], 1).flatten(0, 1)
    if halves:
        raise ValueError(f"checkpoint has half of a split kv_b_proj: {sorted(halves)[:4]}")


class DeepseekV2ForCausalLM(CausalLM):
    architecture = DEEPSEEK_V2

    def make_layer(self, i: int) -> nn.Module:
        return LatentLayer(self.config, self.parallel, i - self.start_layer, i, self.rotary)

    def load_weights(self, weights) -> None:
        super().load_weights(join_kv_b(weights))

    def unfused(self) -> str | None:
        return "multi-head latent attention"
