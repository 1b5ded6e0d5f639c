"""Tensor / pipeline parallel groups of ModelRunners in spawned processes (gloo on the CPU, one thread per rank),
set up as the runtime sets them up (ranks.GroupHost in this process, distributed.init in each rank), driven by
rank 0 through the real step protocol (parallel_step.py) while the other ranks serve.

`drive(runner)` is the workload: extend steps (a chunked prompt included, so a later chunk reads a prefix from the
pool) and decode steps with forced tokens, so that runs with different layouts see the same inputs whatever
their logits. Slots are taken from a KVCacheManager, whose table writes reach the other ranks as in serving."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path

import torch

from radixgen.runtime.config import ModelConfig, RuntimeConfig
from radixgen.runtime.engine.ranks import GroupHost
from radixgen.runtime.executor import distributed
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.executor.step_messages import ForwardInput
from radixgen.runtime.loader import read_hf_config
from radixgen.runtime.scheduler.kv_manager import KVCacheManager

GROUP_TIMEOUT_S = 240.0


def drive(runner: ModelRunner, seed: int = 0, decode_steps: int = 4) -> torch.Tensor:
    """float32 logits of every computed row, in order, over a fixed workload (see the module doc)."""
    kv = KVCacheManager.for_runner(runner)
    gen = torch.Generator().manual_seed(seed)
    lens = [7, 19, 3]
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens]
    rows = [kv.table.allocate() for _ in prompts]
    done = [0] * len(prompts)
    out = []

    def step(new: list[list[int]]) -> None:
        ids, pos, slots = [], [], []
        for i, toks in enumerate(new):
            s = kv.allocate(len(toks))
            kv.table.write(rows[i], done[i], s)
            ids += toks
            pos += range(done[i], done[i] + len(toks))
            slots.append(s)
        fi = ForwardInput(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), torch.tensor(rows), list(done),
                          [len(t) for t in new], torch.arange(len(ids)))
        out.append(runner.forward(fi))
        for i, toks in enumerate(new):
            done[i] += len(toks)

    step([p[:n // 2 + 1] for p, n in zip(prompts, lens, strict=True)])  # first chunks
    step([p[n // 2 + 1:] or [5] for p, n in zip(prompts, lens, strict=True)])  # the rest, after a prefix
    for _ in range(decode_steps):
        step([[int(t)] for t in torch.randint(3, 49152, (len(prompts),), generator=gen)])
    return torch.cat(out)


def drive_copy(runner: ModelRunner, copy: bool = True) -> torch.Tensor:
    """A prompt computed into slots S; its KV copied (a KV copy order of the next step) into fresh slots D; then one
    step with the same next token for two rows, one reading the prompt from S, the other from D: float32 logits
    (2, V), equal when every rank has applied the copy. With copy=False the order is left out (D holds zeros)."""
    kv = KVCacheManager.for_runner(runner)
    prompt = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    n = len(prompt)
    a, b = kv.table.allocate(), kv.table.allocate()
    src = kv.allocate(n)
    kv.table.write(a, 0, src)
    runner.forward(ForwardInput(torch.tensor(prompt), torch.arange(n), src, torch.tensor([a]), [0], [n],
                                torch.tensor([n - 1])))
    dst = kv.allocate(n)
    kv.table.write(b, 0, dst)
    if copy:
        kv.copy_slots(src, dst)
    new = kv.allocate(2)
    kv.table.write(a, n, new[:1])
    kv.table.write(b, n, new[1:])
    return runner.forward(ForwardInput(torch.tensor([7, 7]), torch.tensor([n, n]), new, torch.tensor([a, b]), [n, n],
                                       [1, 1], torch.arange(2)))


def drive_determinism(runner: ModelRunner) -> dict:
    from determinism_helpers import group_workload

    return group_workload(runner)


def drive_determinism_alone(runner: ModelRunner) -> tuple[dict, dict]:
    from determinism_helpers import group_workload

    return group_workload(runner, alone=True)


WORKLOADS = {"drive": drive, "drive_copy": drive_copy, "determinism": drive_determinism,
             "determinism_alone": drive_determinism_alone}


def _rank_main(cfg: RuntimeConfig, model_path: str, rank: int, addr: tuple[str, int], out: str,
               fused: bool, workload: str = "drive") -> None:
    try:
        torch.set_num_threads(1)
        distributed.init(cfg, ModelConfig.from_hf(read_hf_config(Path(model_path))), rank, *addr)
        runner = ModelRunner(cfg, model_path)
        if not fused:
            runner.fused_decode = None
        if rank == 0:
            logits = WORKLOADS[workload](runner)
            runner.group.close()
            torch.save({"logits": logits, "fused": runner.fused_decode is not None}, out)
        else:
            runner.group.serve()
    except BaseException:
        with open(f"{out}.rank{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
    # as the runtime's rank processes leave: a process group's destructors may abort once a peer has gone
    os._exit(0)


def run_group(model_path: str, fused: bool = True, workload: str = "drive", **config) -> dict:
    """`drive` (or another of WORKLOADS) on rank 0 of a group with `config` (tp_size, pp_size, ...): rank 0's
    result."""
    cfg = RuntimeConfig(model=model_path, max_total_tokens=2048, max_running_requests=8, dist_timeout=60.0,
                        **config)
    host = GroupHost(cfg, ModelConfig.from_hf(read_hf_config(Path(model_path))))
    out = os.path.join(tempfile.mkdtemp(prefix="radixgen-group-"), "result.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(cfg, model_path, r, host.addr, out, fused, workload))
             for r in range(cfg.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(GROUP_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = [Path(f"{out}.rank{r}.err") for r in range(cfg.world_size)]
    failed = [e.read_text() for e in errors if e.exists()]
    assert not failed, "a rank failed:\n" + "\n".join(failed)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return torch.load(out)


def run_single(model_path: str, fused: bool = True, **config) -> dict:
    """`drive` on one process, for comparison."""
    torch.set_num_threads(1)
    runner = ModelRunner(RuntimeConfig(model=model_path, max_total_tokens=2048, max_running_requests=8, **config))
    if not fused:
        runner.fused_decode = None
    return {"logits": drive(runner), "fused": runner.fused_decode is not None}
