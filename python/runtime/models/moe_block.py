"""The expert block, a part of the MLP slot (models/parts.MLPPart): router, routed experts, and Qwen2-MoE's shared
expert behind its sigmoid gate.

    out = sum over the token's top-k experts e of w_e * down_e(silu(gate_e(x)) * up_e(x))
          [+ sigmoid(x . shared_gate) * shared_expert(x)]

Expert parallelism (ParallelContext.ep; docs/architecture.md): every tp rank of a stage holds the same rows x (the
attention's output is all-reduced), so nothing is dispatched: each rank runs its own experts (1/ep of them, and
1/moe_tp of their MLP columns) on the rows routed to them, and the partial sums are combined by the tp axis'
all-reduce, the collective a dense MLP's row-parallel down projection ends with anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixgen.runtime.config import ModelConfig
from radixgen.runtime.ground.parallel_context import ParallelContext
from radixgen.runtime.ground.sharding import layer_range, split_range
from radixgen.runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixgen.runtime.layers.moe import MoERouting, experts_forward, route
from radixgen.runtime.layers.quantization.experts import GroupedLinear
from radixgen.runtime.models.parts import MOE_GATED_SILU, GatedMLP, MLPPart, MLPStructure, MoEStructure
from radixgen.runtime.models.weights import ExpertShard


def _read(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


class Experts(nn.Module):
    """This rank's experts [first, first + n) of E, columns [i_start, i_start + i_local) of their intermediate I:
    gate_up (n, 2 i_local, H), gate rows first, and down (n, H, i_local). Loads per-expert tensors (an ExpertShard
    with its expert) and all-expert stacks (expert None: transformers' fused gate_up_proj / down_proj, a GGUF
    file's *_exps), taking only this rank's experts and columns."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, par: ParallelContext) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.first, n = split_range(num_experts, par.ep.size, par.ep.rank)
        if n == 0:
            raise ValueError(f"ep_size={par.ep.size} exceeds the model's {num_experts} experts: a rank would hold none")
        self.i_start, self.i_local = split_range(intermediate, par.moe_tp_size, par.moe_tp_rank)
        self.gate_up = GroupedLinear(n, hidden, 2 * self.i_local)
        self.down = GroupedLinear(n, self.i_local, hidden)
        self.gate_up.weight.weight_loader = self._load_gate_up
        self.down.weight.weight_loader = self._load_down

    def _local(self, loaded, shard: ExpertShard) -> list[tuple[int, torch.Tensor]]:
        """(local expert, its (out, in) tensor) of this rank's experts in `loaded`."""
        n = self.gate_up.num_experts
        if shard.expert is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"an all-experts tensor of {loaded.shape[0]} experts, the model has "
                                 f"{self.num_experts}")
            mine = loaded.narrow(0, self.first, n)
            return list(enumerate(mine))
        e = shard.expert - self.first
        if not 0 <= shard.expert < self.num_experts:
            raise ValueError(f"expert {shard.expert} is outside the model's {self.num_experts}")
        return [(e, _read(loaded))] if 0 <= e < n else []  # another expert group's otherwise

    def _check(self, t: torch.Tensor, shape: tuple[int, int], what: str) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(f"{what}: expected {shape}, got {tuple(t.shape)}")

    def _load_gate_up(self, param, loaded, shard: ExpertShard) -> None:
        """(the parts go through the layer's method: a GGUF file's blocks are collected, not copied)"""
        s, n, full, h = self.i_start, self.i_local, self.intermediate, self.gate_up.in_features
        put = self.gate_up.method.load
        for e, t in self._local(loaded, shard):
            if shard.part == "gate_up":  # (2I, H): gate rows then up rows
                self._check(t, (2 * full, h), f"expert {e + self.first}'s gate_up")
                put(self.gate_up, e, 0, t.narrow(0, s, n))
                put(self.gate_up, e, n, t.narrow(0, full + s, n))
            else:
                self._check(t, (full, h), f"expert {e + self.first}'s {shard.part}")
                put(self.gate_up, e, 0 if shard.part == "gate" else n, t.narrow(0, s, n))

    def _load_down(self, param, loaded, shard: ExpertShard) -> None:
        for e, t in self._local(loaded, shard):
            self._check(t, (self.down.out_features, self.intermediate), f"expert {e + self.first}'s down")
            self.down.method.load(self.down, e, 0, t.narrow(1, self.i_start, self.i_local))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense gated MLP of its own width, column / row parallel over tp."""

    def __init__(self, hidden: int, intermediate: int, par: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, tp=par.tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=par.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """The router's (E, H) weight (replicated: every rank routes every row); Qwen2-MoE's shared-expert gate (1, H)
    is one too (a GGUF file stores it as a vector). `fixed_matmul`: the deterministic mode's matmul for it
    (layers/fixed_experts.FixedRouter: a row's logits do not depend on the rows beside it), else F.linear."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.fixed_matmul = None
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param, loaded, shard=None) -> None:
        t = _read(loaded)
        if t.numel() != param.numel() or t.shape[-1] != param.shape[-1]:
            raise ValueError(f"expected {tuple(param.shape)}, got {tuple(t.shape)}")
        param.data.copy_(t.reshape(param.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_matmul is not None:
            return self.fixed_matmul(x)
        return F.linear(x, self.weight)


class SparseMoEBlock(MLPPart):
    """Router `gate`, `experts`, and (cfg.moe.shared_intermediate_size > 0) `shared_expert` with
    `shared_expert_gate`: the parameter names of the checkpoints (Mixtral's block_sparse_moe renamed mlp)."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer_id: int) -> None:
        super().__init__()
        moe = cfg.moe
        self.tp = par.tp
        self.routing = MoERouting(moe.num_experts, moe.top_k, softmax_before_topk=True,
                                  norm_topk_prob=moe.norm_topk_prob)
        self.gate = Router(moe.num_experts, cfg.hidden_size)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, par)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_intermediate_size, par)
            self.shared_expert_gate = Router(1, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H): routing in float32 from logits in x's dtype (as the references compute them)."""
        weights, ids = route(self.gate(x), self.routing)
        out = experts_forward(x, weights, ids, self.experts.gate_up, self.experts.down,
                              first_expert=self.experts.first)
        out = self.tp.all_reduce(out)  # the expert groups' and column shards' partial sums
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def structure(self) -> MLPStructure:
        shared = None if self.shared_expert is None else (self.shared_expert.gate_up_proj,
                                                          self.shared_expert.down_proj)
        moe = MoEStructure(self.routing, self.gate.weight, self.experts.gate_up, self.experts.down, shared,
                           None if self.shared_expert_gate is None else self.shared_expert_gate.weight,
                           self.experts.first)
        linears = {} if shared is None else {"shared_gate_up": shared[0], "shared_down": shared[1]}
        return MLPStructure(MOE_GATED_SILU, linears, self.experts.i_local, graph_safe=False, moe=moe)


def moe_mlp(cfg: ModelConfig, par: ParallelContext, layer_id: int) -> MLPPart:
    """The MLP part of a layer of an MoE config: an expert block where cfg.moe.sparse_layers has the layer (its
    index in the model: layer_id counts this pipeline stage's layers), else (and with no experts at all) the dense
    gated MLP."""
    start, _ = layer_range(cfg.num_layers, par.pp_size, par.pp_rank)
    if cfg.moe is not None and start + layer_id in cfg.moe.sparse_layers:
        return SparseMoEBlock(cfg, par, layer_id)
    return GatedMLP(cfg, par, layer_id)
