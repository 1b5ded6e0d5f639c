"""The fused mixture-of-experts forward for CUDA (Triton), beside its torch reference `fused_moe_ref`:

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, j]

over the experts [first_expert, first_expert + E) that gate_up (E, 2I, H; gate rows first) and down (E, H, I) hold
(expert parallelism: the others' terms are another rank's; a token routed to none of these gets zeros). x (T, H)
float32, bf16 or fp16, the weights of x's dtype; topk_weights (T, k) float32, topk_ids (T, k) int32.

Strategy: the (token, j) places are sorted by expert on the device (no host sync) and each expert's run padded to
whole blocks of BM places (`sort_places`: places (blocks BM,) with -1 for padding, the expert of each block, -1
for blocks past the end; the grid is the bound T k / BM + E, so it needs no count from the device). Then one launch
for all experts per matmul: gate_up with the SiLU-gated product fused into its epilogue, writing the (places, I)
activation in sorted order; down with the routing weight in its epilogue, writing each place's float32 term to
its own row (no atomics). The k terms of a token are summed in order j = 0 .. k-1 in float32 and rounded once, as
the reference: the result does not depend on which other tokens share an expert. Each matmul output and the SiLU
round to x's dtype, as the torch path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, check_contiguous, check_same_device, check_tensor, expect, require_triton


def sort_places(topk_ids: torch.Tensor, n_local: int, first_expert: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(places (blocks * bm,) int32, block_expert (blocks,) int32): the (token, j) places routed to experts
    [first_expert, + n_local), grouped by expert (stable), each expert's run padded with -1 to a multiple of bm;
    block b holds places [b bm, (b + 1) bm), all of expert block_expert[b] (-1: an unused block)."""
    flat = topk_ids.reshape(-1).to(torch.int64) - first_expert
    n = flat.numel()
    blocks = n // bm + n_local + 1  # a bound: each expert adds at most one partial block
    dev = flat.device
    local = torch.where((flat >= 0) & (flat < n_local), flat, n_local)  # n_local: another rank's
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=n_local + 1)[:n_local]
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    starts = ends - padded  # each expert's first row in the padded order
    sorted_e = local.index_select(0, order)
    first_sorted = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    mine = sorted_e < n_local
    e_safe = torch.where(mine, sorted_e, 0)
    dest = starts.index_select(0, e_safe) + torch.arange(n, device=dev) - first_sorted.index_select(0, e_safe)
    places = torch.full((blocks * bm,), -1, dtype=torch.int32, device=dev)
    places.index_copy_(0, dest[mine], order[mine].to(torch.int32))
    block_rows = torch.arange(blocks, device=dev) * bm
    block_expert = torch.searchsorted(ends, block_rows, right=True)
    block_expert = torch.where(block_expert < n_local, block_expert, -1).to(torch.int32)
    return places, block_expert


def _check(x, gate_up, down, topk_weights, topk_ids) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("gate_up", gate_up, 3, (x.dtype,))
    check_tensor("down", down, 3, (x.dtype,))
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32,))
    t, h = x.shape
    e, two_i, gh = gate_up.shape
    expect(gh == h and two_i % 2 == 0, f"gate_up must be (E, 2I, {h}), got {tuple(gate_up.shape)}")
    expect(tuple(down.shape) == (e, h, two_i // 2), f"down must be ({e}, {h}, {two_i // 2}), got {tuple(down.shape)}")
    expect(topk_ids.shape[0] == t and topk_weights.shape == topk_ids.shape,
           f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be ({t}, k)")
    for name, v in (("x", x), ("gate_up", gate_up), ("down", down), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        check_contiguous(name, v)
    check_same_device(x=x, gate_up=gate_up, down=down, topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """(T, H) in x's dtype: see the module docstring."""
    _check(x, gate_up, down, topk_weights, topk_ids)
    require_triton("fused_moe", "fused_moe_ref")
    from ._fused_moe_triton import block_size, launch_fused_moe

    t, k = topk_ids.shape
    if t == 0:
        return torch.empty_like(x)
    bm = block_size(t * k)
    places, block_expert = sort_places(topk_ids, gate_up.shape[0], first_expert, bm)
    terms = launch_fused_moe(x, gate_up, down, topk_weights, places, block_expert, bm).view(t, k, -1)
    out = terms[:, 0].clone()
    for j in range(1, k):  # the k terms of a token added in order
        out += terms[:, j]
    return out.to(x.dtype)


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    t, k = topk_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        term = torch.zeros_like(out)
        for e in range(gate_up.shape[0]):
            rows = (topk_ids[:, j].long() == e + first_expert).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            g, u = F.linear(x[rows].float(), gate_up[e].float()).to(x.dtype).chunk(2, dim=-1)
            y = F.linear((F.silu(g) * u).float(), down[e].float()).to(x.dtype)
            term[rows] = y.float() * topk_weights[rows, j:j + 1]
        out = term if j == 0 else out + term
    return out.to(x.dtype)
