"""The parallel context: this rank's place on each parallel axis and the axis' collectives.

A `ParallelContext` is made once per process (distributed.init for a rank of a group, `SINGLE` otherwise) and
handed to the model at build time; the model hands each layer the axis it splits over (a linear layer the tp
axis). No layer reads a global while it is built or run, so two models of different layouts can live in one
process (a test builds a tp-2 shard beside a tp-1 model).

Axes: tp (tensor parallelism: the ranks of one pipeline stage), pp (pipeline stages: the ranks of one tp index
across the stages) and ep (expert parallelism, SGLang's layout: ep_size divides tp_size, and the tp ranks of a
stage are ep_size expert groups of tp_size / ep_size ranks each; tp rank r is ep rank r // (tp_size / ep_size),
and its expert group splits those experts' MLP columns tp_size / ep_size ways, `moe_tp`). The ep axis needs no
group of its own: an expert block's combine is the tp axis' all-reduce (docs/architecture.md), so its group
stays None. Each axis has its rank,
size and process group, and the collectives over that group: all_reduce, all_gather, all_to_all, and the two a
vocabulary-parallel LM head and the step protocol use (gather_first, broadcast_from_first). At size 1 every
collective is a no-op returning its input, so layers call them unconditionally. A failing collective (a rank
died or hung past the group's timeout) raises GroupError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixgen.runtime.group_store import GroupError


def guard(fn, what: str):
    """fn() with a lost or hung peer's RuntimeError (gloo's and NCCL's DistBackendError) as a GroupError."""
    try:
        return fn()
    except RuntimeError as e:
        raise GroupError(f"{what} failed: {e}") from e


@dataclass(frozen=True)
class ParallelAxis:
    """One axis: this rank's index `rank` among `size` ranks, whose world ranks are `ranks` (in axis order), and
    their torch ProcessGroup (None at size 1)."""

    name: str
    rank: int = 0
    size: int = 1
    group: object | None = field(default=None, compare=False)
    ranks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or len(self.ranks) != self.size:
            raise ValueError(f"parallel axis {self.name}: rank {self.rank} of size {self.size} over world ranks "
                             f"{self.ranks} is not a place on it")

    @classmethod
    def shard(cls, name: str, rank: int, size: int) -> ParallelAxis:
        """An axis of `size` ranks with no process group, for building one rank's shard in one process (tests, and
        sizing another rank's share); its collectives must not be called (they raise)."""
        return cls(name, rank, size, None, tuple(range(size)))

    @property
    def first(self) -> int:
        """The world rank of the axis' first rank."""
        return self.ranks[0]

    def _dist(self):
        if self.group is None:
            raise RuntimeError(f"the {self.name} axis of size {self.size} has no process group (a shard built "
                               f"outside a group cannot run a collective)")
        import torch.distributed as dist

        return dist

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the axis, in place; returns it."""
        if self.size > 1:
            dist = self._dist()
            guard(lambda: dist.all_reduce(t, group=self.group), f"{self.name} all_reduce")
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (all of one shape) concatenated along `dim` in axis order, on every rank."""
        if self.size == 1:
            return t
        dist = self._dist()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        guard(lambda: dist.all_gather(parts, t, group=self.group), f"{self.name} all_gather")
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, send_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Rows of `t` (dim 0) cut into `send_counts` pieces (None: `size` equal ones), piece i sent to axis rank
        i; returns the pieces received, concatenated in the senders' order, and how many rows came from each
        (what an expert-parallel dispatch and its combine exchange). The counts are exchanged first when given."""
        if send_counts is not None and (len(send_counts) != self.size or sum(send_counts) != t.shape[0]):
            raise ValueError(f"{self.name} all_to_all: send_counts {send_counts} must be {self.size} counts summing "
                             f"to the {t.shape[0]} rows")
        if self.size == 1:
            return t, [t.shape[0]]
        dist = self._dist()
        t = t.contiguous()
        if send_counts is None:
            if t.shape[0] % self.size:
                raise ValueError(f"{self.name} all_to_all: {t.shape[0]} rows do not split into {self.size} equal "
                                 f"pieces; pass send_counts")
            out = torch.empty_like(t)
            guard(lambda: dist.all_to_all_single(out, t, group=self.group), f"{self.name} all_to_all")
            return out, [t.shape[0] // self.size] * self.size
        sent = torch.tensor(send_counts, dtype=torch.int64, device=t.device)
        got = torch.empty_like(sent)
        guard(lambda: dist.all_to_all_single(got, sent, group=self.group), f"{self.name} all_to_all (counts)")
        recv_counts = got.tolist()
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        guard(lambda: dist.all_to_all_single(out, t, recv_counts, list(send_counts), group=self.group),
              f"{self.name} all_to_all")
        return out, recv_counts

    def gather_first(self, t: torch.Tensor, length: int) -> torch.Tensor | None:
        """The ranks' equal pieces (.., n) concatenated along the last dim and cut to `length`, on the axis' first
        rank; None on the others. `t` itself at size 1."""
        if self.size == 1:
            return t
        dist = self._dist()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        guard(lambda: dist.gather(t, parts, dst=self.first, group=self.group), f"{self.name} gather")
        return torch.cat(parts, dim=-1)[..., :length] if parts is not None else None

    def broadcast_from_first(self, t: torch.Tensor) -> torch.Tensor:
        """`t` of the axis' first rank, into `t` on the others (in place)."""
        if self.size > 1:
            dist = self._dist()
            guard(lambda: dist.broadcast(t, src=self.first, group=self.group), f"{self.name} broadcast")
        return t


@dataclass(frozen=True)
class ParallelContext:
    """This process's ranks: world rank r of tp.size * pp.size is pipeline stage r // tp.size and tensor-parallel
    rank r % tp.size; its ep rank tp.rank // moe_tp_size among ep.size expert groups (ranks of one stage)."""

    world_rank: int = 0
    tp: ParallelAxis = ParallelAxis("tp")
    pp: ParallelAxis = ParallelAxis("pp")
    ep: ParallelAxis = ParallelAxis("ep")
    nnodes: int = 1

    @classmethod
    def layout(cls, world_rank: int, tp_size: int, pp_size: int, nnodes: int = 1, tp_group=None,
               pp_group=None, ep_size: int = 1) -> ParallelContext:
        """The context of `world_rank` in a tp_size x pp_size group, with the groups it belongs to (None: a
        layout only, whose collectives at size > 1 raise); ep_size (a divisor of tp_size) expert groups."""
        if ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide tp_size={tp_size} (expert groups of the tp ranks)")
        tp_rank, pp_rank = world_rank % tp_size, world_rank // tp_size
        tp = ParallelAxis("tp", tp_rank, tp_size, tp_group,
                          tuple(range(pp_rank * tp_size, (pp_rank + 1) * tp_size)))
        pp = ParallelAxis("pp", pp_rank, pp_size, pp_group, tuple(s * tp_size + tp_rank for s in range(pp_size)))
        moe_tp = tp_size // ep_size
        ep = ParallelAxis("ep", tp_rank // moe_tp, ep_size, None,
                          tuple(pp_rank * tp_size + e * moe_tp + tp_rank % moe_tp for e in range(ep_size)))
        return cls(world_rank, tp, pp, ep, nnodes)

    # the layout in the terms the step protocol and the KV sizing use
    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def moe_tp_size(self) -> int:
        """The ranks of one expert group, which split its experts' MLP columns."""
        return self.tp.size // self.ep.size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp.rank % self.moe_tp_size

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def world_size(self) -> int:
        return self.tp.size * self.pp.size

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp.size + tp_rank


SINGLE = ParallelContext()  # one rank: every axis of size 1
