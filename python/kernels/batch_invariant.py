"""Batch-invariant kernels (the deterministic mode on CUDA): a row's output bits depend on that row's inputs only,
never on how many rows share the call, where the row sits, or how a context was chunked. Each beside its torch
reference (`<name>_ref`, the same signature; the references round like the kernels only approximately).

- fixed_matmul: y (M, N) = x (M, K) @ w (N, K)^T (+ bias), dense weights. One tile shape per platform whatever
  M, the whole K in one program in fixed steps (no split-K, whose split count would follow the grid), the row
  count unspecialized. torch's matmul (cuBLAS) picks its algorithm, tiles and split by M.
- decode_attention_fixed: decode attention with every context cut at multiples of `piece` positions
  (kernels.cpu.FIXED_PIECE, as on the CPU) and the pieces merged in order; the default kernel's split count
  follows the batch size.
- extend_attention_fixed: every new token run as the decode query at its own position through the same kernel,
  so its bits equal what a decode step at that position gives, whatever the chunking of the prompt.
- row_log_softmax / row_sum / row_cumsum_ / row_argmax: the sampler's reductions, one program per row walking it
  in fixed blocks from column 0 (torch's reductions and scans pick their launch shape by the row count; a cumsum
  of one row takes another algorithm than of many). row_argmax: the first index of the largest value.

The Triton RMSNorm (norm.py) already runs one program per row with a block chosen from the width only, and
rotary / store_kv are elementwise: they need no variant.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_same_device, check_tensor, expect, require_triton
from .attention import _check_decode, _check_extend


def _check_matmul(x, w, bias) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("w", w, 2, (x.dtype,))
    expect(x.shape[1] == w.shape[1], f"x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K")
    expect(x.stride(1) == 1 and w.stride(1) == 1, "x and w need unit stride along K")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,))
        expect(bias.shape[0] == w.shape[0] and bias.stride(0) == 1, f"bias must be ({w.shape[0]},) contiguous")
    check_same_device(x=x, w=w, bias=bias)


def fixed_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), w (N, K), both unit stride along K, the same float dtype -> (M, N) in x's dtype (float32
    accumulation, rounded once)."""
    _check_matmul(x, w, bias)
    require_triton("fixed_matmul", "fixed_matmul_ref")
    from ._batch_invariant_triton import launch_fixed_matmul

    return launch_fixed_matmul(x, w, bias)


def fixed_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_matmul(x, w, bias)
    y = x.float() @ w.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def decode_attention_fixed(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale: float, piece: int,
                           num_kv_splits: int | None = None, *, k_scales=None, v_scales=None) -> torch.Tensor:
    """decode_attention's contract (attention.py), every context summed over fixed pieces of `piece` positions (a
    multiple of the kernel's key block: 64 compiled, 16 interpreted). num_kv_splits: at least ceil(longest context
    / piece), known on the host (None: the pieces of req_to_slot's width, no device read)."""
    sm_scale = _check_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale, num_kv_splits,
                             k_scales, v_scales)
    _check_piece(piece)
    require_triton("decode_attention_fixed", "decode_attention_ref")
    from ._attention_triton import launch_decode

    return launch_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, seq_lens, sm_scale, num_kv_splits,
                         k_scales, v_scales, piece=piece)


def extend_attention_fixed(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens,
                           sm_scale: float, piece: int, num_kv_splits: int | None = None, *, k_scales=None,
                           v_scales=None) -> torch.Tensor:
    """extend_attention's contract (attention.py); token i of request b gets exactly decode_attention_fixed's
    result for context prefix_lens[b] + i + 1. num_kv_splits as for decode_attention_fixed."""
    sm_scale = _check_extend(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens, sm_scale,
                             k_scales, v_scales)
    _check_piece(piece)
    require_triton("extend_attention_fixed", "extend_attention_ref")
    from ._batch_invariant_triton import launch_extend_as_decode

    if q.shape[0] == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return launch_extend_as_decode(q, k_buffer, v_buffer, req_to_slot, req_indices, prefix_lens, extend_lens,
                                   sm_scale, piece, num_kv_splits, k_scales, v_scales)


def _check_piece(piece) -> None:
    # a whole number of the kernel's key blocks: 16 keys interpreted, 64 compiled (launch_decode checks that)
    expect(isinstance(piece, int) and piece > 0 and piece % 16 == 0,
           f"piece must be a positive multiple of 16, got {piece!r}")


def _check_rows(name: str, x: torch.Tensor) -> None:
    check_tensor(name, x, 2, (torch.float32,))
    expect(x.stride(1) == 1, f"{name} needs unit stride along its rows")


def row_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """(B, V) float32 -> (B, V) log-softmax per row (a row of -inf only gives NaN, as torch's does)."""
    _check_rows("x", x)
    require_triton("row_log_softmax", "row_log_softmax_ref")
    from . import _batch_invariant_triton as t

    return t.row_log_softmax(x)


def row_log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    _check_rows("x", x)
    return torch.log_softmax(x, dim=-1)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """(B, V) float32 -> (B,) each row's sum."""
    _check_rows("x", x)
    require_triton("row_sum", "row_sum_ref")
    from . import _batch_invariant_triton as t

    return t.row_sum(x)


def row_sum_ref(x: torch.Tensor) -> torch.Tensor:
    _check_rows("x", x)
    return x.sum(-1)


def row_cumsum_(x: torch.Tensor) -> torch.Tensor:
    """(B, V) float32, overwritten by each row's inclusive running sum; returns x."""
    _check_rows("x", x)
    require_triton("row_cumsum_", "row_cumsum_ref_")
    from . import _batch_invariant_triton as t

    return t.row_cumsum_(x)


def row_cumsum_ref_(x: torch.Tensor) -> torch.Tensor:
    _check_rows("x", x)
    return x.cumsum_(-1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """(B, V) float32 without NaN -> (B,) int64, the first index of each row's largest value."""
    _check_rows("x", x)
    require_triton("row_argmax", "row_argmax_ref")
    from . import _batch_invariant_triton as t

    return t.row_argmax(x)


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    _check_rows("x", x)
    return x.argmax(-1)
