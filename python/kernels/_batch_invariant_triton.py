"""Triton bodies of the batch-invariant kernels (see batch_invariant.py for the contracts and why each is).

Every launch here picks its tiles, warps and stages from the weight's or the row's width only, never from the
row count, and no kernel splits a reduction across programs: an output element is one program's sum over its K
(or its row) in fixed steps, so the same inputs give it the same bits however many rows share the call. The row
count is passed unspecialized (`do_not_specialize`), so a batch of 16 rows does not compile another variant
than a batch of 15 would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_triton import _dot, launch_decode
from ._triton_env import INTERPRET, check_launchable

# the matmul's tiles: one set per platform, whatever M (the interpreter's are small to keep the tests fast)
TILES = (16, 512, 64) if INTERPRET else (64, 64, 64)  # BM, BN, BK (interpreted: few, wide programs)
ROW_BLOCK = 128 if INTERPRET else 1024  # the row kernels' step along a row
MID_BYTES = 256 << 20  # at most this much scratch for extend-as-decode's partial outputs at once


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _fixed_matmul_kernel(
    X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):  # the whole K in one program, in order: no split whose count follows M
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mm[:, None] & mk[None, :],
                    other=0.0)
        w = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None], mask=mk[:, None] & mn[None, :],
                    other=0.0)  # (BK, BN): W^T's tile
        acc += _dot(x, w, DOT_PRECISION, WIDEN_DOT)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def launch_fixed_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    check_launchable(x.device, "fixed_matmul", "fixed_matmul_ref")
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = TILES
    _fixed_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, w if bias is None else bias, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        WIDEN_DOT=INTERPRET and x.dtype != torch.float32, num_warps=4, num_stages=3,
    )
    return y


# ------------------------------------------------------------------------------------------------ row kernels
# One program per row, walking it in ROW_BLOCK steps from column 0: a block's elements are combined by the same
# tree whatever the row's neighbours, and the blocks in order.

@triton.jit
def _row_max(X, n, BLOCK: tl.constexpr):
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(X + offs, mask=offs < n, other=float("-inf")))
    return tl.max(m, 0)


@triton.jit
def _log_softmax_kernel(X, Y, n, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    m = _row_max(x_row, n, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n, other=float("-inf"))
        acc += tl.where(x == float("-inf"), 0.0, tl.exp(x - m))  # (a row of -inf only: m is -inf too)
    lse = m + tl.log(tl.sum(acc, 0))
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n, other=0.0)
        tl.store(y_row + offs, x - lse, mask=offs < n)


@triton.jit
def _sum_kernel(X, Y, n, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        acc += tl.load(X + row * stride_x + offs, mask=offs < n, other=0.0)
    tl.store(Y + row, tl.sum(acc, 0))


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _cumsum_kernel(X, n, stride_x, BLOCK: tl.constexpr):
    """In place, inclusive: each element is the previous blocks' total (added one block at a time, in order) plus
    its block's prefix. An element's sum depends on the elements before it and on where the blocks start
    (column 0), never on the row's length or its neighbours."""
    row = tl.program_id(0).to(tl.int64)
    carry = tl.zeros([1], tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < n, other=0.0)
        scan = tl.associative_scan(x, 0, _add)
        tl.store(X + row * stride_x + offs, scan + carry, mask=offs < n)
        carry += tl.sum(tl.where(offs == c0 + BLOCK - 1, scan, 0.0), 0)  # the block's last prefix


@triton.jit
def _argmax_kernel(X, Out, n, stride_x, BLOCK: tl.constexpr):
    """The first index of the row's largest value (NaN: never; the sampler has replaced them)."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < n, other=float("-inf"))
        # strictly larger only: the blocks come in order, so a tie keeps the earlier index
        take = ((x > best) | (best_i == 2147483647)) & (offs < n)
        best = tl.where(take, x, best)
        best_i = tl.where(take, offs, best_i)
    top = tl.max(best, 0)
    tl.store(Out + row, tl.min(tl.where(best == top, best_i, 2147483647), 0).to(tl.int64))


def _rows(kernel, x: torch.Tensor, *outs, name: str) -> None:
    check_launchable(x.device, name, f"{name}_ref")
    rows, n = x.shape
    if rows == 0 or n == 0:
        return
    # one block size whatever n: a prefix of a row (the sampler's candidates) then sums in the row's own tree
    kernel[(rows,)](x, *outs, n, *(t.stride(0) for t in (x, *outs) if t.dim() == 2), BLOCK=ROW_BLOCK, num_warps=4)


def row_log_softmax(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _rows(_log_softmax_kernel, x, y, name="row_log_softmax")
    return y


def row_sum(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _rows(_sum_kernel, x, y, name="row_sum")
    return y


def row_cumsum_(x: torch.Tensor) -> torch.Tensor:
    _rows(_cumsum_kernel, x, name="row_cumsum_")
    return x


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[1] == 0:
        return y.zero_()
    _rows(_argmax_kernel, x, y, name="row_argmax")
    return y


# ---------------------------------------------------------------------------------------- extend attention

def launch_extend_as_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens, sm_scale,
                            piece: int, num_kv_splits: int | None, k_scales=None, v_scales=None):
    """Every new token a decode query at its own position (request b's token i: context prefix_b + i + 1), run by
    the fixed-piece decode kernel: its bits are those a decode step at that position gives, however the prompt
    was chunked and whatever else shares the step."""
    num_tokens = q.shape[0]
    reps = extend_lens.long()
    tok_req = torch.repeat_interleave(req_indices.long(), reps, output_size=num_tokens)
    first = torch.cumsum(reps, 0) - reps  # each request's first row in q
    start = torch.repeat_interleave(prefix_lens.long() - first + 1, reps, output_size=num_tokens)
    seq_lens = start + torch.arange(num_tokens, device=q.device)  # prefix_b + i + 1
    # the decode kernel's partial outputs take (tokens, heads, splits, head_dim) float32: bounded by running the
    # tokens in groups (each token's result is its own either way)
    splits = num_kv_splits or triton.cdiv(req_to_slot.shape[1], piece)
    group = max(1, MID_BYTES // (4 * q.shape[1] * q.shape[2] * splits))
    if group >= num_tokens:
        return launch_decode(q, k_buffer, v_buffer, req_to_slot, tok_req, seq_lens, sm_scale, splits, k_scales,
                             v_scales, piece=piece)
    return torch.cat([launch_decode(q[t:t + group], k_buffer, v_buffer, req_to_slot, tok_req[t:t + group],
                                    seq_lens[t:t + group], sm_scale, splits, k_scales, v_scales, piece=piece)
                      for t in range(0, num_tokens, group)])
