"""An expert block's two steps: routing (router logits -> each token's top-k experts and their weights) and the
experts' forward over the rows routed to them (the torch reference; kernels replace `experts_forward`'s body by
dispatch on device and grouped method, its signature stays).

Routing rules, as the reference models define them (transformers' modeling files):
- Qwen2-MoE, Qwen3-MoE: softmax over all experts in float32, top-k of the probabilities, then (norm_topk_prob)
  the k weights divided by their sum, else kept as they are (they sum to less than 1).
- Mixtral: softmax over all experts in float32, top-k, always renormalised (norm_topk_prob=True); equal in
  value to a softmax over the k chosen logits, but computed the reference's way so that ties and rounding match.
- softmax_before_topk=False (a model that ranks raw logits): top-k of the logits, softmax over the k chosen
  (the weights then sum to 1 already; norm_topk_prob changes nothing there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixgen import kernels
from radixgen.kernels import cpu_moe
from radixgen.runtime.layers.quantization.experts import (
    CpuGroupedLinear,
    DenseGroupedLinear,
    GroupedLinear,
    group_by_expert,
)


@dataclass(frozen=True)
class MoERouting:
    """How a block picks its experts: `top_k` of `num_experts` per token, the softmax over all experts before the
    top-k (Qwen, Mixtral) or over the k chosen after it, and whether the k weights are renormalised to sum 1."""

    num_experts: int
    top_k: int
    softmax_before_topk: bool = True
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE routing: top_k={self.top_k} of num_experts={self.num_experts} must satisfy "
                             f"1 <= top_k <= num_experts")


def route(router_logits: torch.Tensor, routing: MoERouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (topk_weights (T, k) float32, topk_ids (T, k) int32), ids in descending weight
    order (torch.topk's, ties to the lower index as the reference's)."""
    if router_logits.dim() != 2 or router_logits.shape[1] != routing.num_experts:
        raise ValueError(f"router logits must be (T, {routing.num_experts}), got {tuple(router_logits.shape)}")
    logits = router_logits.float()
    if routing.softmax_before_topk:
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, routing.top_k, dim=-1)
        if routing.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights, ids.to(torch.int32)


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: GroupedLinear,
                    down: GroupedLinear, *, first_expert: int = 0) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], for the experts this
    rank holds: gate_up (E_local, 2I, H) with the gate rows first, down (E_local, H, I), global experts
    [first_expert, first_expert + E_local) (expert parallelism: the other experts' terms are another rank's, and
    a token routed to none of these gets zeros). x (T, H) -> (T, H) in x's dtype.

    Rows are grouped by expert (group_by_expert: expert order, stable within one), each expert applied once to
    its rows; the weighted terms go back to their (token, j) place and are summed over j in order 0..k-1 in
    float32, so a token's result does not depend on which other tokens share its experts."""
    t, k = topk_ids.shape
    n_local = gate_up.num_experts
    if x.dim() != 2 or x.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"experts_forward: x {tuple(x.shape)}, weights {tuple(topk_weights.shape)} and ids "
                         f"{tuple(topk_ids.shape)} must be (T, H), (T, k), (T, k)")
    if down.num_experts != n_local or gate_up.out_features != 2 * down.in_features:
        raise ValueError(f"experts_forward: gate_up {gate_up.num_experts}x{gate_up.out_features} and down "
                         f"{down.num_experts}x{down.in_features} are not one block's (E, 2I) and (E, I)")
    fused = _fused_experts(x, topk_weights, topk_ids, gate_up, down, first_expert)
    if fused is not None:
        return fused
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert  # (T*k,) this rank's expert index
    mine = ((local >= 0) & (local < n_local)).nonzero().squeeze(-1)  # (N,) the (token, j) places routed here
    terms = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)  # (T*k, H)
    if mine.numel():
        order, counts = group_by_expert(local.index_select(0, mine), n_local)
        places = mine.index_select(0, order)  # (N,) grouped by expert
        h = gate_up(x.index_select(0, places // k), counts)  # (N, 2I)
        gate, up = h.chunk(2, dim=-1)
        y = down(F.silu(gate) * up, counts)  # (N, H)
        w = topk_weights.reshape(-1).index_select(0, places).float()
        terms.index_copy_(0, places, y.float() * w.unsqueeze(-1))
    terms = terms.view(t, k, -1)
    out = terms[:, 0].clone()
    for j in range(1, k):  # the k terms of a token added in order
        out += terms[:, j]
    return out.to(x.dtype)


def _fused_experts(x, topk_weights, topk_ids, gate_up: GroupedLinear, down: GroupedLinear,
                   first_expert: int) -> torch.Tensor | None:
    """The whole expert forward in one kernel where one takes these experts, else None (the torch body above):
    on the CPU, both layers packed for the C matmuls (CpuGroupedLinear), one C call that groups the rows by expert
    and runs gate_up, the gated SiLU and down per expert (radixgen.kernels.cpu_moe); on CUDA, the dense experts in
    one Triton launch per matmul (radixgen.kernels.fused_moe)."""
    if x.is_cpu and isinstance(gate_up.method, CpuGroupedLinear) and isinstance(down.method, CpuGroupedLinear) \
            and x.dtype in (torch.bfloat16, torch.float32):
        return cpu_moe._moe_experts(gate_up.method.kl, x.contiguous(), topk_weights.float().contiguous(),
                                    topk_ids.to(torch.int32).contiguous(), gate_up.packed, down.packed, first_expert)
    if x.is_cuda and all(isinstance(g.method, DenseGroupedLinear) and g.weight.dtype == x.dtype
                         for g in (gate_up, down)):
        return kernels.fused_moe(x.contiguous(), gate_up.weight, down.weight, topk_weights.float().contiguous(),
                                 topk_ids.to(torch.int32).contiguous(), first_expert)
    return None
