"""The adapter pool: the weights of the resident LoRA adapters, stacked per layer and merged projection.

For each layer and each reserved merged projection ("group": qkv_proj, o_proj, gate_up_proj, down_proj, the
fused step's matmul order) the pool holds, for all `num_slots` slots at once,
    a (S, nseg R / 16, in / 2, 16, 2): shrink weights A (nseg R, in); segment g (q | k | v, gate | up) is rows
                             [g R, g R + r)
    b (S, out / 16, R / 2, 16, 2): expand weights B^T (out, R); output columns of segment g use ranks [0, r)
both in K-pair blocks of 16 rows (kernels/lora.py pack_kpairs: the layout the CPU kernels stream)
with R the pool's rank (max_lora_rank rounded up to even) and r the adapter's own (the rest zero), plus each
slot's scale and its rank per layer and group (0: that adapter has no weights there). A step's delta of a
group is then, for each slot s present, y[rows_s] += (x[rows_s] @ a[s]^T)[:, segment] @ B_s[:, cols] * scale_s
(layers/ops.py lora_delta_).

The pool only holds weights; which adapter sits in which slot is the scheduler's LoRA manager's (manager.py).
`stage` (any thread) lays an adapter out as one slot's tensors, `write` (the scheduler's thread, between steps)
copies them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixgen.kernels.lora import pack_kpairs
from radixgen.runtime.lora.adapter import TARGETS, LoRAAdapter, LoRAAdapterError, parse_lora_paths, peek_adapter

DEFAULT_MAX_RANK = 16  # the pool's rank when neither max_lora_rank nor a start adapter says
GROUPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_moe_targets(what: str, targets) -> None:
    """A mixture-of-experts model takes attention adapters only: its MLP slots are expert blocks (per-expert LoRA
    weights are not implemented), so MLP targets are refused rather than applied to some layers."""
    mlp = sorted(set(targets) - set(ATTENTION_TARGETS))
    if mlp:
        raise LoRAAdapterError(f"{what} targets {mlp}: this mixture-of-experts model takes attention-only LoRA "
                               f"adapters ({' '.join(ATTENTION_TARGETS)}); adapters of its MLP / expert modules are "
                               f"not supported")


@dataclass(frozen=True)
class GroupShape:
    in_features: int
    out_sizes: tuple[int, ...]  # per segment

    @property
    def segments(self) -> list[tuple[int, int]]:
        """(first, last + 1) output column of each segment."""
        out, c = [], 0
        for n in self.out_sizes:
            out.append((c, c + n))
            c += n
        return out


def group_shapes(mc) -> dict[str, GroupShape]:
    """The merged projections of a ModelConfig (tensor-parallel size 1)."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"qkv_proj": GroupShape(h, (q, kv, kv)), "o_proj": GroupShape(q, (h,)),
            "gate_up_proj": GroupShape(h, (i, i)), "down_proj": GroupShape(i, (h,))}


class StagedAdapter(NamedTuple):
    """One adapter laid out as a slot of the pool (built off the scheduler's thread)."""

    name: str
    scale: float
    ranks: list[list[int]]  # [layer][group index]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, group) -> the slot's (a, b)


class LoRARows(NamedTuple):
    """Rows of a step grouped by adapter slot: (slot, rows, scale) with rows a slice where they are contiguous,
    else an index tensor; and the same as flat tensors for the Triton kernels (built on first use)."""

    groups: list[tuple[int, slice | torch.Tensor, float]]
    num_rows: int
    tensors: dict  # "rows", "starts", "lens", "slots" on the device, "max_len": filled by `as_tensors`

    def seg_end(self, segments: list[tuple[int, int]]) -> torch.Tensor:
        """The last column + 1 of each output segment, for the C kernel (kept per step: layers share them)."""
        key = tuple(segments)
        if key not in self.tensors:
            self.tensors[key] = torch.tensor([e for _, e in segments], dtype=torch.int64)
        return self.tensors[key]

    def as_tensors(self, device: torch.device) -> dict:
        if "rows" not in self.tensors:
            rows, starts, lens, slots, pos = [], [], [], [], 0
            for slot, idx, _ in self.groups:
                ids = list(range(idx.start, idx.stop)) if isinstance(idx, slice) else idx.tolist()
                rows += ids
                starts.append(pos)
                lens.append(len(ids))
                slots.append(slot)
                pos += len(ids)
            for key, values in (("rows", rows), ("starts", starts), ("lens", lens), ("slots", slots)):
                self.tensors[key] = torch.tensor(values, dtype=torch.int64, device=device)
            self.tensors["max_len"] = max(lens)
        return self.tensors


def group_rows(row_slots: list[int], scales: list[float]) -> LoRARows | None:
    """LoRARows of rows whose slot is row_slots[i] (-1: none); None when no row has an adapter."""
    runs: dict[int, list[tuple[int, int]]] = {}
    prev, start = -1, 0
    for i, slot in enumerate([*row_slots, -1]):  # a trailing -1 closes the last run
        if slot != prev:
            if prev >= 0:
                runs.setdefault(prev, []).append((start, i))
            prev, start = slot, i
    if not runs:
        return None
    groups = []
    for slot, spans in runs.items():
        if len(spans) == 1:
            idx: slice | torch.Tensor = slice(*spans[0])
        else:
            idx = torch.cat([torch.arange(a, b) for a, b in spans])
        groups.append((slot, idx, scales[slot]))
    return LoRARows(groups, len(row_slots), {})


class LoRABatch:
    """One step's adapter rows (the forward context's `lora`): every token row, and the kept rows of a step whose
    last layer computes only some of them (ForwardContext.keep_rows)."""

    def __init__(self, row_slots: list[int], scales: list[float]) -> None:
        self.row_slots, self.scales = row_slots, scales
        self.all = group_rows(row_slots, scales)
        self._kept: tuple[torch.Tensor, LoRARows | None] | None = None

    def rows_for(self, n: int, keep: torch.Tensor | None) -> LoRARows | None:
        """The grouping of a linear layer's input of n rows: every row, or the kept rows."""
        if n == len(self.row_slots):
            return self.all
        if keep is None or keep.numel() != n:
            raise ValueError(f"a LoRA layer got {n} rows in a step of {len(self.row_slots)} (kept: "
                             f"{None if keep is None else keep.numel()})")
        if self._kept is None or self._kept[0] is not keep:
            self._kept = (keep, group_rows([self.row_slots[r] for r in keep.tolist()], self.scales))
        return self._kept[1]


class LoRAPool:
    def __init__(self, mc, num_slots: int, max_rank: int, targets: set[str], dtype: torch.dtype,
                 device: torch.device) -> None:
        """`targets`: the target modules (q_proj...) to reserve room for; a group is reserved if any of its
        members is."""
        self.num_slots, self.max_rank, self.dtype, self.device = num_slots, max_rank, dtype, device
        self.rank = r = max_rank + max_rank % 2  # R: ranks go in pairs
        self.num_layers = mc.num_layers
        self.moe = mc.moe is not None
        self.shapes = group_shapes(mc)
        self.targets = frozenset(targets)
        self.groups = [g for g in GROUPS if self.targets & set(MEMBERS[g])]
        # a[l][g], b[l][g]: see the module docstring
        self.a = [{g: torch.zeros((num_slots, -(-len(self.shapes[g].out_sizes) * r // 16),
                                   self.shapes[g].in_features // 2, 16, 2), dtype=dtype, device=device)
                   for g in self.groups} for _ in range(self.num_layers)]
        self.b = [{g: torch.zeros((num_slots, -(-sum(self.shapes[g].out_sizes) // 16), r // 2, 16, 2), dtype=dtype,
                               device=device) for g in self.groups} for _ in range(self.num_layers)]
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.ranks = torch.zeros((self.num_layers, num_slots, len(GROUPS)), dtype=torch.int32)  # host: read by the
        # torch path and the C kernels
        self.scale_list = [0.0] * num_slots  # a host copy, read by the torch path without a device sync

    @classmethod
    def for_config(cls, cfg, mc, dtype: torch.dtype, device: torch.device) -> LoRAPool:
        """The pool of a RuntimeConfig: max_loras slots; its rank and modules as given, else those the start
        adapters (--lora-paths) need (their configs are read, not their weights), else rank 16 and every module."""
        peeks = [peek_adapter(name, path) for name, path in parse_lora_paths(cfg.lora_paths)]
        rank = cfg.max_lora_rank or max((r for r, _ in peeks), default=DEFAULT_MAX_RANK)
        if "all" in cfg.lora_target_modules or not (cfg.lora_target_modules or peeks):
            targets = set(TARGETS)
            if mc.moe is not None:  # "every module" of a mixture of experts: its attention's
                targets = set(ATTENTION_TARGETS)
        else:
            targets = set(cfg.lora_target_modules) or {m for _, ms in peeks for m in ms}
        if mc.moe is not None:
            check_moe_targets("the LoRA pool", targets)
        return cls(mc, cfg.max_loras, rank, targets, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())

    def check(self, adapter: LoRAAdapter) -> None:
        """LoRAAdapterError when the adapter does not fit this pool: rank above R, or modules it has no room for."""
        if self.moe:
            check_moe_targets(f"LoRA adapter {adapter.name!r}", adapter.target_modules)
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank "
                                   f"{self.max_rank}")
        missing = sorted(set(adapter.target_modules) - self.targets)
        if missing:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: target modules {missing} are not among the "
                                   f"modules this server reserves LoRA room for ({sorted(self.targets)}; see "
                                   f"--lora-target-modules)")

    def stage(self, adapter: LoRAAdapter) -> StagedAdapter:
        """The adapter's tensors as one slot (checked with `check` first). Reads only the pool's geometry: safe
        from any thread."""
        self.check(adapter)
        r, rank = self.rank, adapter.rank
        ranks = [[0] * len(GROUPS) for _ in range(self.num_layers)]
        weights = {}
        for layer in range(self.num_layers):
            for gi, g in enumerate(GROUPS):
                if g not in self.groups:
                    continue
                shape = self.shapes[g]
                a = torch.zeros((len(shape.out_sizes) * r, shape.in_features), dtype=self.dtype)
                b = torch.zeros((r, sum(shape.out_sizes)), dtype=self.dtype)
                found = False
                for seg, (module, (c0, c1)) in enumerate(zip(MEMBERS[g], shape.segments, strict=True)):
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    a[seg * r:seg * r + rank] = pair[0]  # (rank, in)
                    b[:rank, c0:c1] = pair[1].t()  # B (out, rank) transposed
                    found = True
                if found:
                    ranks[layer][gi] = rank + rank % 2  # the kernels take ranks in pairs
                    weights[(layer, g)] = (pack_kpairs(a), pack_kpairs(b.t()))
        return StagedAdapter(adapter.name, adapter.scale, ranks, weights)

    def write(self, slot: int, staged: StagedAdapter) -> None:
        """Put a staged adapter in `slot` (no step may be running: the scheduler's thread, between steps)."""
        for layer in range(self.num_layers):
            for g in self.groups:
                pair = staged.weights.get((layer, g))
                if pair is None:
                    self.a[layer][g][slot].zero_()
                    self.b[layer][g][slot].zero_()
                else:
                    self.a[layer][g][slot].copy_(pair[0])
                    self.b[layer][g][slot].copy_(pair[1])
        self.ranks[:, slot] = torch.tensor(staged.ranks, dtype=torch.int32)
        self.scales[slot] = staged.scale
        self.scale_list[slot] = staged.scale

    def batch(self, req_slots: list[int] | None, extend_lens: list[int]) -> LoRABatch | None:
        """The step's LoRABatch from each request's slot (-1: the base model) and new-token count; None when no
        request has an adapter."""
        if req_slots is None or all(s < 0 for s in req_slots):
            return None
        rows = [s for s, e in zip(req_slots, extend_lens, strict=True) for _ in range(e)]
        return LoRABatch(rows, self.scale_list)

    def fused_weights(self):
        """The pool as the fused CPU decode step reads it (kernels.cpu_fused.LoRAStepWeights; bf16 pools)."""
        from radixgen.kernels.cpu_fused import LoRAStepWeights

        layers = [[(self.a[i][g], self.b[i][g]) if g in self.groups else None for g in GROUPS]
                  for i in range(self.num_layers)]
        return LoRAStepWeights(layers, self.scales, self.ranks, self.rank)
