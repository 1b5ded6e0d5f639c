"""The fused CPU decode step: all decoder layers of a bf16 Llama-family model (Llama, Mistral, Qwen2, Qwen3) for a
decode batch of up to `MAX_BATCH` requests in one C call (radixgen.kernels.cpu_fused.decode_step).

Small decode batches on a CPU are bound by streaming the weights through the matmuls; what the unfused path
adds on top (a Python call, a tensor allocation and a thread fork/join per op, a cold start of every matmul)
is most of the rest of the step. The fused step runs the same math with the same bf16 roundings inside one
OpenMP team, LM head and embedding gather included, reading the linear layers' own packed weights
(radixgen.kernels.cpu_linear: bf16 K pairs, which its kernel streams at 45-55 GB/s here where oneDNN reaches
about 20-30 on the same matrices at batch 1, or int8 / int4 dequantized in registers). Larger batches, prefill,
float32 and layers in another layout (fp8, GPTQ's activation order) keep the unfused path.
"""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_fused, cpu_linear
from radixgen.kernels.cpu import CKernels
from radixgen.runtime import distributed

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
                 scale: float, lora: cpu_fused.LoRAStepWeights | None = None, piece: int = 0) -> None:
        self.kl, self.weights, self.model, self.cos_sin_cache, self.scale = kl, weights, model, cos_sin_cache, scale
        self.lora = lora
        self.piece = piece  # > 0: attention over fixed pieces of the contexts (the deterministic mode)
        self.hook = cpu_fused.TensorParallelHook(distributed.all_reduce) if distributed.tp_size() > 1 else None

    @classmethod
    def build(cls, model, kv_pool, kl: CKernels, lora_pool=None, piece: int = 0) -> FusedDecode | None:
        """The fused step for `model` over `kv_pool` on the kernels `kl` (with the LoRA deltas of `lora_pool`, a
        lora.pool.LoRAPool, added after each matmul; attention over fixed pieces of `piece` positions when > 0),
        or None where it does not apply."""
        from radixgen.runtime.models.llama import LlamaAttention, LlamaForCausalLM

        if not kl.has_decode_step or not isinstance(model, LlamaForCausalLM):
            return None
        mine = list(model.layers[model.start_layer:model.end_layer])  # this pipeline stage's
        attn = mine[0].self_attn
        # per-head q/k norms are supported in Qwen3's form (q_norm / k_norm RMSNorms), no other override
        qk_norms = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        norm = mine[0].input_layernorm.weight  # the activations' dtype and device (the linear weights are packed)
        inter = mine[0].mlp.down_proj.in_features  # this rank's share
        if ((type(attn).qk_norm is not LlamaAttention.qk_norm and not qk_norms)
                or norm.dtype != torch.bfloat16 or not norm.is_cpu or attn.head_dim > kl.d_max):
            return None

        def packed(layer):  # the layer's own weight as the C matmuls read it, or None
            return layer.method.packed_weight(layer)

        lora = lora_pool.fused_weights() if lora_pool is not None else None
        layers = []
        for i, layer in enumerate(mine):
            a, mlp = layer.self_attn, layer.mlp
            matmuls = {"qkv": packed(a.qkv_proj), "o": packed(a.o_proj), "gate_up": packed(mlp.gate_up_proj),
                       "down": packed(mlp.down_proj)}
            if any(w is None for w in matmuls.values()):
                return None
            layers.append({"input_norm": layer.input_layernorm.weight, "qkv_bias": a.qkv_proj.bias, **matmuls,
                           "post_norm": layer.post_attention_layernorm.weight,
                           "q_norm": a.q_norm.weight if qk_norms else None,
                           "k_norm": a.k_norm.weight if qk_norms else None, **_pool_of(kv_pool, i),
                           "lora": lora.address(model.start_layer + i) if lora is not None else None})
        last = model.is_last_stage
        embed = None  # a rank whose step starts from embedded rows or a previous stage's output reads no table
        if model.is_first_stage and distributed.tp_size() == 1:
            table = model.embed_tokens.table
            embed = packed(table) if table is model.lm_head else cpu_linear.pack_rows(table.weight)
            if embed is None:
                return None
        lm_head = packed(model.lm_head) if last else None
        if last and lm_head is None:
            return None
        weights = cpu_fused.DecodeStepWeights(
            kl, layers, model.norm.weight if last else None, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, intermediate=inter,
            eps=model.config.rms_norm_eps, embed=embed, lm_head=lm_head)
        return cls(kl, weights, model, attn.rotary.cos_sin_cache, attn.attn.scale, lora, piece)

    def applies(self, extend_lens: list[int], verify: bool = False) -> bool:
        """Whether a step with these per-request new-token counts is one the fused path takes: a decode step, or
        with `verify` a verification of draft tokens (model_runner.ForwardInput.verify)."""
        if not verify:
            return len(extend_lens) <= MAX_BATCH and all(e == 1 for e in extend_lens)
        return sum(extend_lens) <= MAX_BATCH and max(extend_lens, default=1) <= MAX_ROWS_PER_REQUEST

    def __call__(self, fi, req_to_slot: torch.Tensor, stage_input=None):
        """The float32 logits (N, vocab) of `fi.logit_rows` for a step `applies` takes (a
        model_runner.ForwardInput); writes the step's K/V into the pool. Kept to few torch calls: at batch 1 each
        costs several times its usual price right after the step has streamed the weights through the caches.

        On a rank of a parallel group: a stage after the first starts from `stage_input` (a StageHidden), a stage
        before the last returns its StageHidden (copies: the step's buffers are reused), and the logits are on
        the last stage's first tensor-parallel rank only (None on the others)."""
        from radixgen.runtime.models.llama import StageHidden

        ids, pos, slots, rows = (t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
                                 for t in (fi.input_ids, fi.positions, fi.out_slots, fi.req_indices))
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
        out, logits = cpu_fused.decode_step(self.kl, self.weights, ids, pos, self.cos_sin_cache, slots, req_to_slot,
                                            rows, max_len, self.scale, io, requests=n, piece=self.piece)
        if not model.is_last_stage:
            return StageHidden(out.clone(), logits.clone())
        return model.lm_head.gather(logits.index_select(0, fi.logit_rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 logits of up to MAX_BATCH bf16 final hidden states on the step's LM head (a prefill's sampled
        rows), straight into float32 (the head's C matmul writes the bf16-rounded logits widened). Gathered as
        __call__'s."""
        return self.model.lm_head.gather(cpu_fused.lm_head_logits(self.kl, self.weights, hidden))


def _pool_of(kv_pool, i: int) -> dict:
    """Layer i's KV tensors for DecodeStepWeights: buffers, and an 8-bit pool's scales."""
    kv = kv_pool.layer(i)
    return {"k_buf": kv.k, "v_buf": kv.v, "k_scale": kv.k_scales, "v_scale": kv.v_scales}
