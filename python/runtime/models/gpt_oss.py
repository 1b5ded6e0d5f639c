"""gpt-oss: the decoder with biases on q, k, v and o, a learned sink logit per query head, sliding-window layers
alternating with full ones (config.layer_types), YaRN rotary, and in every layer an expert block of its own kind:
a router with a bias whose top-k logits are softmaxed, and experts whose gate and up columns are interleaved in one
(E, hidden, 2I) tensor, each with a bias, through a clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)
with g = min(gate, l).

Weights: the bf16 layout (experts.gate_up_proj (E, hidden, 2I), down_proj (E, I, hidden) and their biases), the
published MXFP4 checkpoints' expert blocks (experts.*_blocks / *_scales), and llama.cpp's GGUF files
(quantization="gguf"). MXFP4 experts stay in their blocks on the CPU's C kernels (one matmul per expert and part
reading the 4.25 bits a weight: layers/quantization/gguf_experts), a checkpoint's blocks repacked at load into
the GGUF block layout (the same bits: `repack_mxfp4`); under the torch ops and on CUDA they are dequantized to the
model's dtype at load. The expert block runs on one rank (tp_size 1), the rows of each expert a step routes to in
one grouped matmul."""

from __future__ import annotations

import torch
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.layers.quantization.experts import GroupedLinear, group_by_expert
from radixgen.runtime.layers.quantization.gguf import GGUFGroupedLinear, GGUFStack
from radixgen.runtime.models.decoder import Architecture, CausalLM
from radixgen.runtime.models.moe_block import Experts
from radixgen.runtime.models.parts import AttentionSpec, MLPPart, MLPStructure
from radixgen.runtime.models.weights import ATTENTION_WEIGHTS, DECODER_WEIGHTS, QKV_BIAS_WEIGHTS, WeightMapping

MOE_CLAMPED_SWIGLU = "moe_clamped_swiglu"  # an MLP kind the fused paths do not run

# the 16 values of an FP4 (e2m1) code, by its 4 bits: sign, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ExpertBlock(MLPPart):
    """The router (weight (E, hidden), bias (E,)) and the experts: moe_block.Experts' grouped gate_up (E, 2I, hidden),
    gate rows first, and down (E, hidden, I), in whatever layout the weight format's grouped method keeps (a GGUF
    file's MXFP4 stacks in their blocks), with their biases beside them (gate, up (E, I), down (E, hidden))."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int) -> None:
        super().__init__()
        if par.tp.size > 1:
            raise ValueError("gpt-oss runs with tp_size 1 (its expert block is not split over ranks yet)")
        hf = cfg.hf
        e, h, i = hf["num_local_experts"], cfg.hidden_size, cfg.intermediate_size
        self.num_experts, self.top_k = e, hf["num_experts_per_tok"]
        self.alpha, self.limit = float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))
        self.router = nn.Module()
        self.router.weight, self.router.bias = _param(e, h), _param(e)
        self.router.fixed_matmul = None  # the deterministic mode's (layers/fixed_experts.FixedRouter)
        self.experts = Experts(e, h, i, par)
        self.experts.gate_proj_bias, self.experts.up_proj_bias = _param(e, i), _param(e, i)
        self.experts.down_proj_bias = _param(e, h)
        if str((hf.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4":
            for g in (self.experts.gate_up, self.experts.down):  # kept in their blocks where the ops set can
                g.stored_blocks = "MXFP4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden): each token's top-k experts (softmax over the k chosen router logits), the rows
        of one expert applied together; a token's k terms summed in order."""
        t, k = x.shape[0], self.top_k
        r = self.router
        logits = r.fixed_matmul(x) if r.fixed_matmul is not None else nn.functional.linear(x, r.weight, r.bias)
        top, chosen = torch.topk(logits, k, dim=-1)  # (T, k)
        weights = torch.softmax(top, dim=-1)
        ex = self.experts
        order, counts = group_by_expert(chosen, self.num_experts)  # (T*k,) places grouped by expert
        expert = chosen.reshape(-1).index_select(0, order)  # (N,) each place's expert
        h = ex.gate_up(x.index_select(0, order // k), counts)  # (N, 2I)
        gate, up = h.chunk(2, dim=-1)
        gate = (gate + ex.gate_proj_bias.index_select(0, expert)).clamp(max=self.limit)
        up = (up + ex.up_proj_bias.index_select(0, expert)).clamp(-self.limit, self.limit)
        y = ex.down((up + 1) * gate * torch.sigmoid(gate * self.alpha), counts)  # (N, hidden)
        y = (y + ex.down_proj_bias.index_select(0, expert)) * weights.reshape(-1).index_select(0, order)[:, None]
        terms = torch.zeros(t * k, x.shape[1], dtype=y.dtype, device=x.device).index_copy_(0, order, y)
        return terms.view(t, k, -1).sum(dim=1)

    def structure(self) -> MLPStructure:
        return MLPStructure(MOE_CLAMPED_SWIGLU, {}, self.experts.intermediate, graph_safe=False)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (blocks (..., G, 16) uint8: 32 FP4 codes per group, the low nibble first; scales (..., G) uint8, the
    group's power of two + 127) -> values (..., G * 32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks (..., G, 16), scales (..., G))")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # (..., G, 32)
    values = table[codes] * torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 groups (blocks (..., G, 16): codes 2j and 2j + 1 in byte j's low and high nibble; scales
    (..., G)) -> GGUF MXFP4 blocks (..., G * 17): the exponent byte (the same e8m0), then codes j and j + 16 in
    byte j's low and high nibble."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks (..., G, 16), scales (..., G))")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # (..., G, 32) uint8
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.to(torch.uint8).unsqueeze(-1), qs], -1).flatten(-2)


def _stacks(name: str, blocks: torch.Tensor, scales: torch.Tensor):
    """An expert tensor's MXFP4 pair as the grouped experts load GGUF stacks: gate_up_proj's rows (interleaved gate
    / up) as gate_proj and up_proj stacks (E, I, G * 17), down_proj's (E, hidden, G * 17) as they are."""
    raw = repack_mxfp4(blocks, scales)
    columns = blocks.shape[-2] * 32
    if name.endswith("gate_up_proj"):
        base = name.rsplit(".", 1)[0]
        for proj, rows in (("gate_proj", raw[:, 0::2]), ("up_proj", raw[:, 1::2])):
            yield f"{base}.{proj}", GGUFStack(f"{base}.{proj}", "MXFP4", rows.contiguous(), columns)
    else:
        yield name, GGUFStack(name, "MXFP4", raw, columns)


def _dequantized(weights, dtype: torch.dtype, blocks: bool = False):
    """Checkpoint tensors with each expert tensor's MXFP4 pair (<name>_blocks, <name>_scales; (E, out, G, 16) and
    (E, out, G)) replaced by <name> in the bf16 layout (E, in, out), or (blocks) by its GGUF MXFP4 stacks."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                pair = pending.setdefault(base, {})
                pair[suffix] = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
                if len(pair) == 2:
                    del pending[base]
                    if blocks:
                        yield from _stacks(base, pair["_blocks"], pair["_scales"])
                        break
                    yield base, dequantize_mxfp4(pair["_blocks"], pair["_scales"], dtype).transpose(1, 2)
                break
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 tensors without their pair: {sorted(pending)[:4]}")


def _grouped_layout(weights):
    """Checkpoint tensors with transformers' expert layout (gate_up_proj (E, hidden, 2I), gate / up columns
    interleaved; down_proj (E, I, hidden); gate_up_proj_bias (E, 2I)) as the grouped experts load them: the gate and
    up stacks (E, I, hidden), down (E, hidden, I), the gate and up biases apart. A GGUF file's stacks (llama.cpp
    splits and transposes them the same way; named mlp.gguf_experts.*) pass as they are."""
    for name, tensor in weights:
        if isinstance(tensor, GGUFStack):  # a checkpoint's MXFP4 blocks, already as llama.cpp's stacks
            yield name, tensor
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_up_proj_bias")):
            t = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
            base = name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                yield f"{base}.gate_proj", t[..., 0::2].transpose(1, 2)
                yield f"{base}.up_proj", t[..., 1::2].transpose(1, 2)
            elif name.endswith("down_proj"):
                yield f"{base}.down_proj", t.transpose(1, 2)
            else:
                yield f"{base}.gate_proj_bias", t[:, 0::2]
                yield f"{base}.up_proj_bias", t[:, 1::2]
        else:
            yield name, tensor


# llama.cpp's gpt-oss files: the post-attention norm under its own name, o's bias, the sinks, the router's bias, the
# experts split into gate / up / down stacks (MXFP4 blocks) with a bias each, named apart from transformers' experts
# (whose down_proj is (E, I, hidden), the file's (E, hidden, I)) until the mapping renames them
_G = "mlp.gguf_experts."
GPT_OSS_GGUF = WeightMapping(
    gguf_block=(("post_attention_norm.weight", "post_attention_layernorm.weight"),
                ("attn_output.bias", "self_attn.o_proj.bias"), ("attn_sinks.weight", "self_attn.sinks"),
                ("ffn_gate_inp.weight", "mlp.router.weight"), ("ffn_gate_inp.bias", "mlp.router.bias"),
                ("ffn_gate_exps.weight", _G + "gate_proj"), ("ffn_up_exps.weight", _G + "up_proj"),
                ("ffn_down_exps.weight", _G + "down_proj"), ("ffn_gate_exps.bias", _G + "gate_proj_bias"),
                ("ffn_up_exps.bias", _G + "up_proj_bias"), ("ffn_down_exps.bias", _G + "down_proj_bias")),
    gguf_matmuls=frozenset({"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}),
    experts=(("gate_proj", "gate_up", "gate"), ("up_proj", "gate_up", "up"), ("down_proj", "down", "down")),
    renames=((".gguf_experts.", ".experts."),))
GPT_OSS = Architecture("gpt_oss", AttentionSpec(qkv_bias=True, o_bias=True, sinks=True), mlp=ExpertBlock,
                       weights=GPT_OSS_GGUF + DECODER_WEIGHTS + ATTENTION_WEIGHTS + QKV_BIAS_WEIGHTS,
                       gguf_arch="gpt-oss")


class GptOssForCausalLM(CausalLM):
    architecture = GPT_OSS

    def load_weights(self, weights) -> None:
        blocks = any(isinstance(m.method, GGUFGroupedLinear) for m in self.modules() if isinstance(m, GroupedLinear))
        super().load_weights(_grouped_layout(_dequantized(weights, next(self.parameters()).dtype, blocks)))
