"""Attention over the paged KV pool: decode (one new token per request) and extend (prefill after a prefix).

Both read K/V only through the request->slot table: request b's position j lives in slot
req_to_slot[req_indices[b], j]. GQA: query head h reads kv head h // (Hq // Hkv). Softmax and accumulation
are fp32; outputs are in q's dtype.

decode_attention (flash-decoding): request b's length seq_lens[b] is cut into num_kv_splits chunks (the chunk
length is rounded up to whole BLOCK_N blocks, so short requests use fewer splits). Stage 1 runs one program
per (request, kv head, split): it loads that kv head's whole query group as one (BLOCK_H, D) tile, so each K/V
block is read once per group, and it writes a normalised partial output plus its log-sum-exp. Stage 2, one
program per (request, query head), merges the partials weighted by exp(lse - max lse).

extend_attention: one program per (block of BLOCK_M new tokens of one request, query head). The blocks of all
requests are laid end to end on grid axis 0 (a request with n new tokens owns ceil(n / BLOCK_M) of them), so
no length has to be read back to the host. A program walks the keys [0, prefix + last token of its block] in
BLOCK_N blocks with an online softmax; new keys come from the pool too (their K/V were stored beforehand).

The `_ref` functions have the same signatures and are plain torch (also the CPU path of the runtime).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_kv_pool,
    check_same_device,
    check_sm_scale,
    check_tensor,
    expect,
    require_triton,
)
from .kv_quant import gather_rows


def _check_pool(q, k_buffer, v_buffer, req_to_slot, req_indices, k_scales, v_scales) -> None:
    quantized = check_kv_pool(k_buffer, v_buffer, k_scales, v_scales, FLOAT_DTYPES)
    check_tensor("req_to_slot", req_to_slot, 2, INDEX_DTYPES)
    check_tensor("req_indices", req_indices, 1, INDEX_DTYPES)
    expect(quantized or q.dtype == k_buffer.dtype, f"q dtype {q.dtype} must equal the pool dtype {k_buffer.dtype}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    check_dim("k_buffer", k_buffer, 2, head_dim, "head_dim of q")
    expect(num_q_heads % num_kv_heads == 0,
           f"q has {num_q_heads} heads, not a multiple of the pool's {num_kv_heads} kv heads")


def _check_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale,
                  num_kv_splits, k_scales, v_scales) -> float:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    _check_pool(q, k_buffer, v_buffer, req_to_slot, req_indices, k_scales, v_scales)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    check_dim("req_indices", req_indices, 0, q.shape[0], "batch size of q")
    check_dim("seq_lens", seq_lens, 0, q.shape[0], "batch size of q")
    expect(num_kv_splits is None or (isinstance(num_kv_splits, int) and num_kv_splits >= 1),
           f"num_kv_splits must be None or a positive int, got {num_kv_splits!r}")
    check_same_device(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot,
                      req_indices=req_indices, seq_lens=seq_lens, k_scales=k_scales, v_scales=v_scales)
    return check_sm_scale(sm_scale)


def _check_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens,
                  sm_scale, k_scales, v_scales) -> float:
    check_tensor("q", q, 3, FLOAT_DTYPES)
    _check_pool(q, k_buffer, v_buffer, req_to_slot, req_indices, k_scales, v_scales)
    check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES)
    check_tensor("extend_lens", extend_lens, 1, INDEX_DTYPES)
    batch = req_indices.shape[0]
    check_dim("prefix_lens", prefix_lens, 0, batch, "number of requests in req_indices")
    check_dim("extend_lens", extend_lens, 0, batch, "number of requests in req_indices")
    check_same_device(q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_slot=req_to_slot,
                      req_indices=req_indices, prefix_lens=prefix_lens, extend_lens=extend_lens, k_scales=k_scales,
                      v_scales=v_scales)
    return check_sm_scale(sm_scale)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_slot: torch.Tensor, req_indices: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, num_kv_splits: int | None = None, *, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, D), any strides -> o (B, Hq, D) contiguous, in q's dtype. The pool is in q's dtype, or 8-bit
    codes with their scales k_scales / v_scales (radixgen.kernels.kv_quant).

    Request b attends to positions [0, seq_lens[b]); 1 <= seq_lens[b] <= req_to_slot.shape[1] is not
    checked (that would need a device sync). num_kv_splits=None picks enough splits to fill the GPU.
    """
    sm_scale = _check_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale,
                             num_kv_splits, k_scales, v_scales)
    require_triton("decode_attention", "decode_attention_ref")
    from ._attention_triton import launch_decode

    return launch_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale, num_kv_splits,
                         k_scales, v_scales)


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_slot: torch.Tensor, req_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, sm_scale: float, *, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q (T, Hq, D): the new tokens of the B requests back to back, T == sum(extend_lens) -> o (T, Hq, D).
    An 8-bit pool comes with its scales, as for decode_attention.

    New token i of request b sits at position prefix_lens[b] + i and attends to [0, prefix_lens[b] + i].
    T == sum(extend_lens) and prefix + extend <= req_to_slot.shape[1] are not checked (device sync).
    """
    sm_scale = _check_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens,
                             sm_scale, k_scales, v_scales)
    require_triton("extend_attention", "extend_attention_ref")
    from ._attention_triton import launch_extend

    return launch_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens, sm_scale,
                         k_scales, v_scales)


# ----------------------------------------------------------------------------------------------------
# torch references


def _gather(buffer: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """The float32 values of the pool rows at `slots` (any shape): as stored, or dequantized."""
    return gather_rows(buffer, scales, slots.reshape(-1), torch.float32).view(*slots.shape, *buffer.shape[1:])


def _merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs (S, ..., D) normalised partial outputs, lses (S, ...) their log-sum-exp -> (..., D)."""
    weights = torch.softmax(lses, dim=0).nan_to_num(0.0)  # an all -inf column only occurs for seq_len 0
    return (weights.unsqueeze(-1) * outs).sum(0)


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_slot: torch.Tensor, req_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, num_kv_splits: int | None = None, *,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Padded batched torch version (an 8-bit pool dequantized to float32). num_kv_splits=None means one
    split; with S splits each request's positions are cut into S chunks of ceil(seq_len / S), attended
    separately and merged by log-sum-exp, which must give the same result as one split."""
    sm_scale = _check_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale,
                             num_kv_splits, k_scales, v_scales)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    lens = seq_lens.long()
    expect(int(lens.min()) >= 1, "every seq_lens entry must be >= 1")
    max_len = int(lens.max())
    expect(max_len <= req_to_slot.shape[1],
           f"seq_lens up to {max_len} exceed req_to_slot's {req_to_slot.shape[1]} columns")
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < lens[:, None]  # (B, L)
    slots = req_to_slot[req_indices.long(), :max_len].long().masked_fill(~valid, 0)  # padding reads slot 0
    k = _gather(k_buffer, k_scales, slots)  # (B, L, Hkv, D)
    v = _gather(v_buffer, v_scales, slots)
    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale  # (B, Hkv, G, L)

    splits = num_kv_splits or 1
    split_len = (lens + splits - 1) // splits  # (B,)
    split_of = pos[None, :] // split_len[:, None]  # (B, L)
    outs, lses = [], []
    for s in range(splits):
        keep = (valid & (split_of == s))[:, None, None, :]  # (B, 1, 1, L)
        part = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(part, dim=-1)  # (B, Hkv, G); -inf for an empty split
        probs = torch.exp(part - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(torch.einsum("bhgl,blhd->bhgd", probs, v))
        lses.append(lse)
    o = _merge_partials(torch.stack(outs), torch.stack(lses))  # (B, Hkv, G, D)
    return o.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def extend_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_slot: torch.Tensor, req_indices: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, sm_scale: float, *, k_scales: torch.Tensor | None = None,
                         v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One scaled_dot_product_attention per request, in fp32, with an explicit prefix+causal mask."""
    sm_scale = _check_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens,
                             sm_scale, k_scales, v_scales)
    prefixes, extends, rows = prefix_lens.tolist(), extend_lens.tolist(), req_indices.tolist()
    expect(sum(extends) == q.shape[0], f"q has {q.shape[0]} tokens but sum(extend_lens) = {sum(extends)}")
    expect(min(prefixes, default=0) >= 0 and min(extends, default=0) >= 0,
           "prefix_lens and extend_lens must be >= 0")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for prefix, extend, row in zip(prefixes, extends, rows, strict=True):
        total = prefix + extend
        expect(total <= req_to_slot.shape[1],
               f"prefix + extend = {total} exceeds req_to_slot's {req_to_slot.shape[1]} columns")
        if extend == 0:
            continue
        slots = req_to_slot[row, :total].long()
        k = _gather(k_buffer, k_scales, slots).transpose(0, 1)  # (Hkv, total, D)
        v = _gather(v_buffer, v_scales, slots).transpose(0, 1)
        qb = q[start:start + extend].float().transpose(0, 1)  # (Hq, extend, D)
        q_pos = prefix + torch.arange(extend, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # (extend, total)
        ob = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
        o[start:start + extend] = ob.transpose(0, 1).to(q.dtype)
        start += extend
    return o
