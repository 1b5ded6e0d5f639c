"""The fused CPU decode step: all decoder layers of a bf16 decoder model (Llama, Mistral, Qwen2, Qwen3: any whose
layers describe themselves, models.parts.LayerStructure, as the dense gated MLP and rotate-half rotary) for a
decode batch of up to `MAX_BATCH` requests in one C call (radixgen.kernels.cpu_fused.decode_step).

Small decode batches on a CPU are bound by streaming the weights through the matmuls; what the unfused path
adds on top (a Python call, a tensor allocation and a thread fork/join per op, a cold start of every matmul)
is most of the rest of the step. The fused step runs the same math with the same bf16 roundings inside one
OpenMP team, LM head and embedding gather included, reading the linear layers' own packed weights
(radixgen.kernels.cpu_linear: bf16 K pairs, which its kernel streams at 45-55 GB/s here where oneDNN reaches
about 20-30 on the same matrices at batch 1, or int8 / int4 dequantized in registers). Larger batches, prefill,
float32, layers in another layout (fp8, GPTQ's activation order) and models with a part the step does not run
(another rotary, an expert block it cannot take: `supports`, `moe_step_layer`) keep the unfused path.
"""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_fused, cpu_linear, cpu_moe
from radixgen.kernels.cpu import CKernels
from radixgen.runtime.layers.quantization.experts import CpuGroupedLinear
from radixgen.runtime.models.decoder import StageHidden
from radixgen.runtime.models.parts import DENSE_GATED_SILU, MOE_GATED_SILU, ROPE, LayerStructure

MAX_BATCH = 64  # measured: faster than the unfused path up to 64 requests, even at 96, slower at 128
# rows of one request in a verification step (its last token and its draft tokens): the step stores every row's
# K/V before any row attends, and each row attends to positions [0, its own] of its request's table row, so
# consecutive positions of one request come out as an extend computes them, at about the cost of a decode step
# of as many rows (measured, SmolLM2-135M at batch 1: 1 row 7.0 ms, 4 rows 7.7, 8 rows 9.8; an unfused extend of
# 5 tokens about 15); past 8 rows per request the extend kernel, which reads the context once for all, wins
MAX_ROWS_PER_REQUEST = 8


class FusedDecode:
    """The fused step of one model (or of this rank's part of it: its pipeline stage's layers, its tensor-parallel
    shards, the all-reduces inside the C call through a TensorParallelHook, the vocabulary-parallel embedding
    and LM head around it)."""

    def __init__(self, kl: CKernels, weights: cpu_fused.DecodeStepWeights, model, cos_sin_cache: torch.Tensor,
                 scale: float, lora: cpu_fused.LoRAStepWeights | None = None, piece: int = 0,
                 ordered_sum=None) -> None:
        """ordered_sum: the deterministic mode's sum of the ranks' partial sums (layers/fixed_order.OrderedSum) in
        place of the all-reduce, at tp > 1."""
        self.kl, self.weights, self.model, self.cos_sin_cache, self.scale = kl, weights, model, cos_sin_cache, scale
        self.lora = lora
        self.piece = piece  # > 0: attention over fixed pieces of the contexts (the deterministic mode)
        tp = model.parallel.tp
        self.hook = None
        if ordered_sum is not None:
            self.hook = cpu_fused.TensorParallelHook(None, lambda partials, x: ordered_sum(partials, out=x))
        elif tp.size > 1:
            self.hook = cpu_fused.TensorParallelHook(tp.all_reduce)

    @staticmethod
    def supports(layers: list[LayerStructure], d_max: int) -> str | None:
        """Why the fused step cannot run decoder layers `layers` (the model's decoder_structure()), or None where
        it can: every layer the dense gated MLP, rotate-half rotary, bf16 CPU norms, heads of at most d_max."""
        for i, layer in enumerate(layers):
            a = layer.attention
            if layer.mlp.kind not in (DENSE_GATED_SILU, MOE_GATED_SILU) or (
                    layer.mlp.kind == MOE_GATED_SILU and layer.mlp.moe is None):
                return (f"layer {i}'s MLP part is {layer.mlp.kind!r} (the fused step runs {DENSE_GATED_SILU!r} "
                        f"and {MOE_GATED_SILU!r})")
            if a.rotary.kind != ROPE:
                return f"layer {i}'s rotary is {a.rotary.kind!r} (the fused step runs {ROPE!r})"
            if a.variant is not None:  # the masked attention path's (layers/masked_attention.py)
                return f"layer {i}'s attention has {a.variant}"
            if layer.input_norm.dtype != torch.bfloat16 or not layer.input_norm.is_cpu:
                return "the fused step runs bf16 activations on the CPU"
            if a.head_dim > d_max:
                return f"head_dim {a.head_dim} exceeds the kernels' {d_max}"
        return None if layers else "no decoder layer"

    @classmethod
    def build(cls, model, kv_pool, kl: CKernels, lora_pool=None, piece: int = 0) -> FusedDecode | None:
        """The fused step for `model` (a models.decoder.CausalLM: its decoder_structure(), embedding, final norm and
        LM head) over `kv_pool` on the kernels `kl` (with the LoRA deltas of `lora_pool`, a lora.pool.LoRAPool,
        added after each matmul; attention over fixed pieces of `piece` positions when > 0), or None where it
        does not apply (`supports`, or a layer whose weight layout is
        not one the C matmuls read)."""
        if not kl.has_decode_step:
            return None
        mine = model.decoder_structure()  # this pipeline stage's
        if cls.supports(mine, kl.d_max) is not None or getattr(model, "unfused", lambda: None)() is not None:
            return None

        def packed(layer):  # the layer's own weight as the C matmuls read it, or None
            return layer.method.packed_weight(layer)

        lora = lora_pool.fused_weights() if lora_pool is not None else None
        layers = []
        for i, layer in enumerate(mine):
            a, mlp = layer.attention, layer.mlp.linears
            matmuls = {"qkv": packed(a.qkv), "o": packed(a.o)}
            moe = None
            if layer.mlp.kind == MOE_GATED_SILU:
                moe = moe_step_layer(layer.mlp.moe)
                if moe is None:
                    return None
            else:
                matmuls.update(gate_up=packed(mlp["gate_up"]), down=packed(mlp["down"]))
            if any(w is None for w in matmuls.values()):
                return None
            layers.append({"input_norm": layer.input_norm, "qkv_bias": a.qkv_bias, **matmuls,
                           "post_norm": layer.post_norm, "q_norm": a.q_norm, "k_norm": a.k_norm,
                           **_pool_of(kv_pool, i),
                           "lora": lora.address(model.start_layer + i) if lora is not None else None,
                           "moe": moe})
        last = model.is_last_stage
        embed = None  # a rank whose step starts from embedded rows or a previous stage's output reads no table
        if model.is_first_stage and model.parallel.tp.size == 1:
            table = model.embed_tokens.table
            embed = packed(table) if table is model.lm_head else cpu_linear.pack_rows(table.weight)
            if embed is None:
                return None
        lm_head = packed(model.lm_head) if last else None
        if last and lm_head is None:
            return None
        first = mine[0].attention
        weights = cpu_fused.DecodeStepWeights(
            kl, layers, model.norm.weight if last else None, num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, intermediate=_intermediate(layers, mine),
            eps=mine[0].eps, embed=embed, lm_head=lm_head)
        ordered = getattr(first.o, "ordered_sum", None)  # the deterministic mode at tp 2 (layers/fixed_order.py)
        return cls(kl, weights, model, first.rotary.cos_sin_cache, first.scale, lora, piece, ordered)

    def applies(self, extend_lens: list[int], verify: bool = False) -> bool:
        """Whether a step with these per-request new-token counts is one the fused path takes: a decode step, or
        with `verify` a verification of draft tokens (model_runner.ForwardInput.verify)."""
        if not verify:
            return len(extend_lens) <= MAX_BATCH and all(e == 1 for e in extend_lens)
        return sum(extend_lens) <= MAX_BATCH and max(extend_lens, default=1) <= MAX_ROWS_PER_REQUEST

    def positions_fit(self, fi) -> bool:
        """Whether step `fi`'s positions are ones the C step can take (see rotary_at_indices)."""
        return fi.media is None or _row_indices(fi) is not None

    def __call__(self, fi, req_to_slot: torch.Tensor, stage_input=None):
        """The float32 logits (N, vocab) of `fi.logit_rows` for a step `applies` takes (a
        model_runner.ForwardInput); writes the step's K/V into the pool. Kept to few torch calls: at batch 1 each
        costs several times its usual price right after the step has streamed the weights through the caches.

        On a rank of a parallel group: a stage after the first starts from `stage_input` (a StageHidden), a stage
        before the last returns its StageHidden (copies: the step's buffers are reused), and the logits are on
        the last stage's first tensor-parallel rank only (None on the others)."""
        ids, pos, slots, rows = (t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
                                 for t in (fi.input_ids, fi.positions, fi.out_slots, fi.req_indices))
        cos_sin = self.cos_sin_cache
        if fi.media is not None:  # a model's own positions (M-RoPE) may differ from the rows' sequence indices
            pos, cos_sin = rotary_at_indices(fi, pos, cos_sin)
        n = len(fi.extend_lens)
        row_adapters = fi.lora_slots  # each row's adapter slot (None: no row has one)
        if ids.shape[0] != n:  # several rows of a request (a verification): each its request's table row, adapter
            rows = rows.repeat_interleave(torch.tensor(fi.extend_lens), output_size=ids.shape[0])
            if row_adapters is not None:
                row_adapters = [s for s, e in zip(row_adapters, fi.extend_lens, strict=True) for _ in range(e)]
        max_len = max(p + e for p, e in zip(fi.prefix_lens, fi.extend_lens, strict=True))
        model = self.model
        if self.lora is not None:
            self.lora.set_rows(row_adapters)
        io = cpu_fused.StageIO(final=model.is_last_stage, hook=self.hook)
        if stage_input is not None:
            io = io._replace(hidden=stage_input.hidden, residual=stage_input.residual)
        elif self.weights.embed is None:  # the vocabulary-parallel embedding, summed over the ranks
            io = io._replace(embedded=model.embed_tokens(ids))
        # the context split as in a decode step of the same requests, so that a row's attention rounds as there
        out, logits = cpu_fused.decode_step(self.kl, self.weights, ids, pos, cos_sin, slots, req_to_slot,
                                            rows, max_len, self.scale, io, requests=n, piece=self.piece)
        if not model.is_last_stage:
            return StageHidden(out.clone(), logits.clone())
        return model.lm_head.gather(logits.index_select(0, fi.logit_rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 logits of up to MAX_BATCH bf16 final hidden states on the step's LM head (a prefill's sampled
        rows), straight into float32 (the head's C matmul writes the bf16-rounded logits widened). Gathered as
        __call__'s."""
        return self.model.lm_head.gather(cpu_fused.lm_head_logits(self.kl, self.weights, hidden))


def _row_indices(fi) -> torch.Tensor | None:
    """The sequence index of each row of step `fi`, or None where two rows at one index have different positions
    (requests of different M-RoPE deltas at the same length), which no one table serves."""
    idx = torch.tensor([p + j for p, e in zip(fi.prefix_lens, fi.extend_lens, strict=True) for j in range(e)])
    pos = fi.positions.to(torch.int64)
    uniq, inv = torch.unique(idx, return_inverse=True)
    some = torch.empty_like(uniq).scatter_(0, inv, pos)  # one row's position per index
    return idx if torch.equal(some[inv], pos) else None


def rotary_at_indices(fi, pos: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rotary table) for the C step, which takes a row's context as its position + 1: where a
    model's positions are not the rows' sequence indices (M-RoPE's index + delta, models/qwen2_vl.py), the
    indices, over a table whose row at each index is `table`'s row at that row's position (only the rows the
    step reads are written). The step must fit (FusedDecode.positions_fit)."""
    idx = _row_indices(fi)
    if torch.equal(idx, pos):
        return pos, table
    out = table.new_empty((int(idx.max()) + 1, table.shape[1]))
    out[idx] = table[pos]
    return idx, out


def _pool_of(kv_pool, i: int) -> dict:
    """Layer i's KV tensors for DecodeStepWeights: buffers, and an 8-bit pool's scales."""
    kv = kv_pool.layer(i)
    return {"k_buf": kv.k, "v_buf": kv.v, "k_scale": kv.k_scales, "v_scale": kv.v_scales}


def moe_step_layer(moe) -> cpu_moe.MoEStepLayer | None:
    """An expert block (models.parts.MoEStructure: this rank's experts and columns at tp / ep > 1, whose partial
    sums the step's all-reduce hook combines) as the fused step runs it, or None where it cannot: experts not
    packed for the C matmuls (CpuGroupedLinear), a shared expert whose linears are not packed, an intermediate size
    (routed or shared) that is not a multiple of 16 (the step pairs each 16-column gate block with its up block)."""
    gu, down = moe.gate_up, moe.down
    if not all(isinstance(g.method, CpuGroupedLinear) for g in (gu, down)):
        return None
    if moe.router.dtype != torch.bfloat16 or moe.router.shape[1] % 2 or down.packed.k % 16:
        return None
    shared = None
    if moe.shared is not None:
        shared = tuple(lin.method.packed_weight(lin) for lin in moe.shared)
        if any(w is None for w in shared) or shared[1].k % 16:
            return None
    gate = None if moe.shared_gate is None else moe.shared_gate.detach().reshape(-1).contiguous()
    r = moe.routing
    return cpu_moe.MoEStepLayer(cpu_linear.pack_bf16(moe.router.detach()), gu.packed, down.packed,
                                num_experts=r.num_experts, top_k=r.top_k, first_expert=moe.first_expert,
                                softmax_before_topk=r.softmax_before_topk, norm_topk_prob=r.norm_topk_prob,
                                shared=shared, shared_gate=gate)


def _intermediate(layers: list[dict], mine: list[LayerStructure]) -> int:
    """The widest MLP activation of the step's layers (its buffers are sized by it): dense layers', experts' and
    shared experts' intermediate sizes."""
    return max(ly["moe"].intermediate if ly["moe"] is not None else s.mlp.intermediate
               for ly, s in zip(layers, mine, strict=True))
