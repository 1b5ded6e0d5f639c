"""What a rank process is started with, and how a node's ranks and threads are counted: shared by the Engine,
which starts the ranks (engine/ranks.py), and the ranks themselves (scheduler/process.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixgen.runtime.config import RuntimeConfig


@dataclass(frozen=True)
class RankArgs:
    """What a rank process is started with."""

    cfg: RuntimeConfig
    model_path: str
    rank: int = 0
    store_addr: tuple[str, int] | None = None  # the group's TCPStore (None: a single process)
    engine_addrs: tuple[str, str] | None = None  # rank 0: the zmq addresses it pulls from and pushes to


def node_ranks(cfg: RuntimeConfig) -> range:
    """The world ranks of node cfg.node_rank (as many on each node, in order)."""
    per_node = cfg.world_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def rank_threads(cfg: RuntimeConfig) -> int:
    """torch threads of each rank: --num-threads, else the node's CPUs split between its ranks (0: torch's
    default, one process)."""
    if cfg.num_threads or cfg.world_size == 1:
        return cfg.num_threads
    return max(1, (os.cpu_count() or 1) // len(node_ranks(cfg)))
