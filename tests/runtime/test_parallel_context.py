"""The parallel context (ground/parallel_context.py): its layout arithmetic, no-op collectives at size 1, and the
axis collectives over gloo between 2 spawned processes (all_to_all with uneven counts, all_gather, all_reduce)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from radixgen.runtime.ground.parallel_context import SINGLE, ParallelAxis, ParallelContext


def test_layout_places_every_rank_on_its_axes():
    for world in range(6):  # tp 3 x pp 2
        par = ParallelContext.layout(world, 3, 2)
        assert (par.tp.rank, par.pp.rank, par.ep.size) == (world % 3, world // 3, 1)
        assert world in par.tp.ranks and world in par.pp.ranks
        assert par.tp.ranks[par.tp.rank] == world and par.pp.ranks[par.pp.rank] == world
        assert par.rank_of(par.pp_rank, par.tp_rank) == world and par.world_size == 6
    assert ParallelContext.layout(4, 3, 2).pp.ranks == (1, 4) and ParallelContext.layout(4, 3, 2).tp.ranks == (3, 4, 5)
    with pytest.raises(ValueError, match="not a place"):
        ParallelAxis("tp", 2, 2, None, (0, 1))


def test_size_one_collectives_are_no_ops_and_a_shard_refuses_them():
    t = torch.arange(6.0).reshape(3, 2)
    for axis in (SINGLE.tp, SINGLE.pp, SINGLE.ep):
        assert axis.all_reduce(t) is t and axis.all_gather(t) is t and axis.gather_first(t, 2) is t
        out, counts = axis.all_to_all(t, [3])
        assert out is t and counts == [3]
    with pytest.raises(ValueError, match="send_counts"):
        SINGLE.ep.all_to_all(t, [1, 2])
    with pytest.raises(RuntimeError, match="no process group"):
        ParallelAxis.shard("tp", 0, 2).all_reduce(t)


def _rank(rank: int, store_path: str, out: str) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        ep = ParallelAxis("ep", rank, 2, dist.group.WORLD, (0, 1))
        # rank r sends rows tagged 10 * r + destination: rank 0 one row to 0 and two to 1, rank 1 three to 0, none
        # to 1
        counts = [[1, 2], [3, 0]][rank]
        rows = torch.tensor([[10.0 * rank + d, float(i)] for d, n in enumerate(counts) for i in range(n)])
        got, recv_counts = ep.all_to_all(rows, counts)
        equal, _ = ep.all_to_all(torch.arange(4.0).reshape(4, 1) + 100 * rank)
        gathered = ep.all_gather(torch.full((1, 2), float(rank)), dim=0)
        summed = ep.all_reduce(torch.ones(3) * (rank + 1))
        first = ep.gather_first(torch.full((2, 1), float(rank)), 2)
        torch.save({"got": got, "recv_counts": recv_counts, "equal": equal, "gathered": gathered,
                    "summed": summed, "first": first}, f"{out}.{rank}")
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise


def test_axis_collectives_over_gloo_in_two_processes(tmp_path):
    ctx = mp.get_context("spawn")
    out = str(tmp_path / "result")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    errors = [open(f"{out}.{r}.err").read() for r in range(2) if os.path.exists(f"{out}.{r}.err")]
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs)
    r0, r1 = (torch.load(f"{out}.{r}") for r in range(2))
    # rank 0 receives its own row for 0 and rank 1's three rows; rank 1 rank 0's two rows for 1
    assert r0["recv_counts"] == [1, 3] and r1["recv_counts"] == [2, 0]
    assert r0["got"].tolist() == [[0.0, 0.0], [10.0, 0.0], [10.0, 1.0], [10.0, 2.0]]
    assert r1["got"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert r0["equal"].reshape(-1).tolist() == [0.0, 1.0, 100.0, 101.0]
    assert r1["equal"].reshape(-1).tolist() == [2.0, 3.0, 102.0, 103.0]
    for r in (r0, r1):
        assert r["gathered"].tolist() == [[0.0, 0.0], [1.0, 1.0]] and r["summed"].tolist() == [3.0] * 3
    assert r0["first"].tolist() == [[0.0, 1.0]] * 2 and r1["first"] is None
