"""The fused CPU decode step: all decoder layers of a bf16 Llama-family model (Llama, Mistral, Qwen2, Qwen3) for a
decode batch of up to `MAX_BATCH` requests in one C call (radixgen.kernels.cpu_fused.decode_step).

Small decode batches on a CPU are bound by streaming the weights through the matmuls; what the unfused path
adds on top (a Python call, a tensor allocation and a thread fork/join per op, a cold start of every matmul)
is most of the rest of the step. The fused step runs the same math with the same bf16 roundings inside one
OpenMP team, LM head included, on its own copy of the matmul weights in a layout its kernel streams at 45-55
GB/s here (oneDNN reaches about 20-30 on the same matrices at batch 1). Larger batches, prefill and float32
keep the unfused path.
"""

from __future__ import annotations

import torch

from radixgen.kernels import cpu_fused
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
                 scale: float, lora: cpu_fused.LoRAStepWeights | None = None) -> None:
        self.kl, self.weights, self.model, self.cos_sin_cache, self.scale = kl, weights, model, cos_sin_cache, scale
        self.lora = lora
        tp = distributed.tp_size() > 1
        self.hook = cpu_fused.TensorParallelHook(distributed.all_reduce) if tp else None
        # at tp 1 the C step reads the embedding rows itself; a vocabulary-parallel one is looked up here
        self.embed = model.embed_tokens.weight if model.is_first_stage and not tp else None

    @classmethod
    def build(cls, model, kv_pool, kl: CKernels, lora_pool=None) -> FusedDecode | None:
        """The fused step for `model` over `kv_pool` on the kernels `kl` (with the LoRA deltas of `lora_pool`, a
        lora.pool.LoRAPool, added after each matmul), or None where it does not apply."""
        from radixgen.runtime.models.llama import LlamaAttention, LlamaForCausalLM

        if not kl.has_decode_step or not isinstance(model, LlamaForCausalLM):
            return None
        mine = list(model.layers[model.start_layer:model.end_layer])  # this pipeline stage's
        attn = mine[0].self_attn
        # per-head q/k norms are supported in Qwen3's form (q_norm / k_norm RMSNorms), no other override
        qk_norms = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        weight = attn.qkv_proj.weight
        inter = mine[0].mlp.down_proj.in_features  # this rank's share
        if ((type(attn).qk_norm is not LlamaAttention.qk_norm and not qk_norms)
                or weight.dtype != torch.bfloat16 or not weight.is_cpu or attn.head_dim > kl.d_max
                or (model.config.hidden_size | attn.num_heads * attn.head_dim | inter) % 2):  # the K-pair layout
            return None
        lora = lora_pool.fused_weights() if lora_pool is not None else None
        layers = []
        for i, layer in enumerate(mine):
            a, mlp = layer.self_attn, layer.mlp
            layers.append({"input_norm": layer.input_layernorm.weight, "qkv": a.qkv_proj.weight,
                           "qkv_bias": a.qkv_proj.bias, "o": a.o_proj.weight,
                           "post_norm": layer.post_attention_layernorm.weight, "gate_up": mlp.gate_up_proj.weight,
                           "down": mlp.down_proj.weight, "q_norm": a.q_norm.weight if qk_norms else None,
                           "k_norm": a.k_norm.weight if qk_norms else None, **_pool_of(kv_pool, i),
                           "lora": lora.address(model.start_layer + i) if lora is not None else None})
        last = model.is_last_stage
        weights = cpu_fused.DecodeStepWeights(
            kl, layers, model.norm.weight if last else None, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, intermediate=inter,
            eps=model.config.rms_norm_eps, lm_head=model.lm_head.weight if last else None)
        return cls(kl, weights, model, attn.rotary.cos_sin_cache, attn.attn.scale, lora)

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
        if ids.shape[0] != n:  # several rows of a request: each row reads its request's table row
            rows = rows.repeat_interleave(torch.tensor(fi.extend_lens), output_size=ids.shape[0])
        max_len = max(p + e for p, e in zip(fi.prefix_lens, fi.extend_lens, strict=True))
        model = self.model
        if self.lora is not None:  # adapter slots per row: a verification has several rows per request
            self.lora.set_rows(fi.lora_slots if fi.lora_slots is None or ids.shape[0] == n else
                               [s for s, e in zip(fi.lora_slots, fi.extend_lens, strict=True) for _ in range(e)])
        io = cpu_fused.StageIO(final=model.is_last_stage, hook=self.hook)
        if stage_input is not None:
            io = io._replace(hidden=stage_input.hidden, residual=stage_input.residual)
        elif self.embed is None:  # the vocabulary-parallel embedding, summed over the ranks
            io = io._replace(embedded=model.embed_tokens(ids))
        # the context split as in a decode step of the same requests, so that a row's attention rounds as there
        out, logits = cpu_fused.decode_step(self.kl, self.weights, self.embed, ids, pos, self.cos_sin_cache, slots,
                                            req_to_slot, rows, max_len, self.scale, io, requests=n)
        if not model.is_last_stage:
            return StageHidden(out.clone(), logits.clone())
        return model.lm_head.gather(logits.index_select(0, fi.logit_rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 logits of up to MAX_BATCH bf16 final hidden states on the step's packed LM head (a prefill's
        sampled rows): oneDNN streams the head at about half the speed at so few rows. Gathered as __call__'s."""
        return self.model.lm_head.gather(cpu_fused.lm_head_logits(self.kl, self.weights, hidden))


def _pool_of(kv_pool, i: int) -> dict:
    """Layer i's KV tensors for DecodeStepWeights: buffers, and an 8-bit pool's scales."""
    kv = kv_pool.layer(i)
    return {"k_buf": kv.k, "v_buf": kv.v, "k_scale": kv.k_scales, "v_scale": kv.v_scales}
