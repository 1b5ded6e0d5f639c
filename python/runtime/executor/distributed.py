"""Tensor and pipeline parallelism: joining the group, its process groups, set up once per process.

A group of `tp_size * pp_size` processes (ranks) runs one model. World rank r is pipeline stage r // tp_size and
tensor-parallel rank r % tp_size within that stage; the ranks of a stage form its tensor-parallel group, the ranks
of one tensor-parallel index across the stages its pipeline group. `init` returns the rank's ParallelContext
(parallel_context.py: the axes and their collectives), which the model runner hands to the model it builds; with
one rank (the default) nothing is set up and the context is SINGLE, whose collectives are no-ops.

Everything goes through torch.distributed: gloo on the CPU; on CUDA, NCCL for device tensors and gloo for the
host-side step descriptions (one process group with both backends). Setup (`init`) first meets the other ranks
through a torch TCPStore that the Engine's process hosts (engine_client.py): each rank checks that it was
started with the same layout as the group expects (`fingerprint`) and says so in the store, so that a mismatch
or a node that never joins is a clear error rather than a rendezvous that waits forever. Every collective then
runs under the group's timeout (`dist_timeout`): a rank that dies or hangs fails the others' next operation
instead of hanging them.

The sharding arithmetic (which heads, vocabulary rows, MLP columns and layers a rank holds) is ground.sharding:
the layers and models read it without the group's setup.
"""

from __future__ import annotations

import datetime
import json

import torch

from radixgen.runtime.ground.parallel_context import SINGLE, GroupError, ParallelContext, guard  # noqa: F401 (GroupError)
from radixgen.runtime.group_store import (  # noqa: F401 - the store protocol, used here and by the Engine
    ERROR_KEY,
    EXPECT_KEY,
    STARTED_KEY,
    STORE_PREFIX,
    connect_store,
    fingerprint,
    joined_key,
    ready_key,
)

# ---------------------------------------------------------------- this process's context

_context = SINGLE  # what init made (SINGLE until then); the runner takes it once and hands it to the model
_store = None  # this rank's client of the group's TCPStore, once joined
_parent = None  # the pid of the process that started this rank (the Engine's, or a node's launcher)


def context() -> ParallelContext:
    """The parallel context `init` made for this process (SINGLE without a group): read once, by the model runner,
    which passes it to the model it builds."""
    return _context


def rank_device(device: str, par: ParallelContext) -> torch.device:
    """The device of rank `par`: with several ranks on a node, "cuda" (or cuda:N) is the node's GPU of the rank's
    local index (counted from N); the CPU is shared."""
    dev = torch.device(device)
    if dev.type != "cuda" or par.world_size == 1:
        return dev
    return torch.device("cuda", (dev.index or 0) + par.world_rank % par.ranks_per_node)


def init(cfg, model_config, world_rank: int, host: str, port: int) -> ParallelContext:
    """Join the group as `world_rank`: meet the others through the store, check the layout, set up the process
    groups; returns this rank's ParallelContext (also `context()`). Once per process, before the model is built."""
    global _context, _store, _parent
    import os

    import torch.distributed as dist

    _parent = os.getppid()
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    store = _store = connect_store(host, port, cfg.dist_timeout)
    mine = fingerprint(cfg, model_config)
    try:
        expected = store.get(EXPECT_KEY).decode()
    except RuntimeError as e:
        raise GroupError(f"rank {world_rank}: the group's layout did not appear in the store at {host}:{port} "
                         f"within {cfg.dist_timeout:g} s") from e
    if mine != expected:
        diff = _differences(json.loads(expected), json.loads(mine))
        message = f"rank {world_rank} (node {cfg.node_rank}) was started with another layout than node 0: {diff}"
        store.set(ERROR_KEY, message)
        raise GroupError(message)
    store.set(joined_key(world_rank), "1")
    backend = "gloo"
    if cfg.device.startswith("cuda"):  # NCCL for device tensors, gloo for the host-side step descriptions
        backend = "cpu:gloo,cuda:nccl"
        device = rank_device(cfg.device, ParallelContext.layout(world_rank, cfg.tp_size, cfg.pp_size, cfg.nnodes))
        if device.index >= torch.cuda.device_count():
            message = (f"rank {world_rank} needs {device} but node {cfg.node_rank} has "
                       f"{torch.cuda.device_count()} GPU(s): one GPU per rank of a node")
            store.set(ERROR_KEY, message)
            raise GroupError(message)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore(STORE_PREFIX + "pg/", store), rank=world_rank,
                            world_size=cfg.tp_size * cfg.pp_size, timeout=timeout)
    tp_group = pp_group = None
    for stage in range(cfg.pp_size):  # every rank creates every group, in the same order
        ranks = list(range(stage * cfg.tp_size, (stage + 1) * cfg.tp_size))
        group = dist.new_group(ranks, timeout=timeout) if cfg.tp_size > 1 else None
        if world_rank in ranks:
            tp_group = group
    for tp_rank in range(cfg.tp_size):  # the stages' ranks of one tensor-parallel index (the pp axis)
        ranks = list(range(tp_rank, cfg.tp_size * cfg.pp_size, cfg.tp_size))
        group = dist.new_group(ranks, timeout=timeout) if cfg.pp_size > 1 else None
        if world_rank in ranks:
            pp_group = group
    _context = ParallelContext.layout(world_rank, cfg.tp_size, cfg.pp_size, cfg.nnodes, tp_group, pp_group,
                                      cfg.ep_size)
    return _context


def report_failure(message: str) -> None:
    """A rank that failed to start says so in the store, where the Engine of node 0 reads it (first one wins)."""
    if _store is not None:
        try:
            if not _store.check([ERROR_KEY]):
                _store.set(ERROR_KEY, message)
        except RuntimeError:  # the store is gone too: the Engine has gone already
            pass


def mark_ready() -> None:
    """This rank has built its model."""
    if _store is not None:
        _store.set(ready_key(_context.world_rank), "1")


def _wait_for(keys: list[str], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Until the store holds every key (bounded by the start timeout, not the collective one: a slow model load
    is not a hang); GroupError with the first failure a rank reported, naming what did not happen, or when the
    process that started this rank is gone (nobody would stop this one)."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while not _store.check(keys):
        if _store.check([ERROR_KEY]):
            raise GroupError(_store.get(ERROR_KEY).decode())
        if os.getppid() != _parent:
            raise GroupError("the process that started this rank has exited")
        if time.monotonic() > deadline:
            raise GroupError(f"{what} within {timeout_s:g} s")
        time.sleep(poll_s)


def wait_until_ready(timeout_s: float) -> None:
    """Rank 0: until every rank has built its model."""
    mark_ready()
    keys = [ready_key(r) for r in range(_context.world_size)]
    _wait_for(keys, timeout_s, "not every rank finished loading the model")


def mark_started() -> None:
    """Rank 0 is ready to serve: the other ranks start waiting for steps (under the collective timeout)."""
    _store.set(STARTED_KEY, "1")


def wait_for_start(timeout_s: float) -> None:
    """A rank other than 0, once ready: until rank 0 is (its own start may take longer than dist_timeout)."""
    _wait_for([STARTED_KEY], timeout_s, "rank 0 did not start serving")


def _differences(expected: dict, mine: dict, prefix: str = "") -> str:
    out = []
    for key in sorted(set(expected) | set(mine)):
        a, b = expected.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = _differences(a, b, f"{prefix}{key}.")
            if sub:
                out.append(sub)
        elif a != b:
            out.append(f"{prefix}{key}={b!r} (node 0: {a!r})")
    return "; ".join(out)


def destroy() -> None:
    global _context
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _context = SINGLE


# ---------------------------------------------------------------- point-to-point (world ranks; the axes' collectives
# are ParallelAxis methods)


def isend(t: torch.Tensor, dst: int):
    """Start sending `t` to world rank `dst`; the returned work's wait() ends it (keep `t` alive until then)."""
    import torch.distributed as dist

    return guard(lambda: dist.isend(t, dst), f"send to rank {dst}")


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into `t` from world rank `src` (blocking)."""
    import torch.distributed as dist

    guard(lambda: dist.recv(t, src), f"receive from rank {src}")
    return t


def irecv(t: torch.Tensor, src: int):
    import torch.distributed as dist

    return guard(lambda: dist.irecv(t, src), f"receive from rank {src}")


def wait(work) -> None:
    guard(work.wait, "a point-to-point transfer")

