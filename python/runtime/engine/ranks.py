"""The processes of a model: one per rank of a tensor / pipeline parallel group (one in all without it).

Each rank is a fresh interpreter, `python -m radixgen.runtime.scheduler ARGS_FILE`, the file holding its
`RankArgs`. Rank 0 is the scheduler process the Engine talks to; the other ranks of node 0 are started by the
Engine beside it, those of node N > 0 by `radixgen serve --node-rank N` (`run_node`), which serves nothing.
Node 0's Engine process also hosts the group's meeting point (`GroupHost`, a torch TCPStore at
--dist-init-addr): it writes the layout every rank must have been started with and watches the ranks join,
so that a taken port, a mismatched node or a node that never comes are clear errors within dist_timeout.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

from radixgen.common.options import split_addr
from radixgen.runtime import group_store
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.rank_args import RankArgs, node_ranks

POLL_S = 0.5


# libgomp's threads spin this many pauses at a barrier before they sleep (its default without OMP_WAIT_POLICY is
# 300,000, milliseconds on this CPU). A fused decode step meets at about five barriers a layer; where other work
# shares the cores, a thread spinning for a partner the kernel has descheduled burns the partner's time, and a
# 0.5B model's batch-1 step took 3-5x longer (about 250 ms against 85 at a load of 5 on 2 cores). This short
# spin (libgomp's own choice when it sees more threads than cores) still catches a partner that is running.
GOMP_SPINCOUNT = "1000"


def rank_env(environ) -> dict[str, str]:
    """A rank process's environment: the caller's, with these defaults where it sets none of them."""
    env = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch backs its large CPU allocations (weights, KV pool) with
    # transparent huge pages when this is set before its first one: fewer TLB misses while decode streams the
    # weights (about 3% at batch 1)
    if "OMP_WAIT_POLICY" not in environ:  # a wait policy asked for is kept as it is
        env["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    return {**env, **environ}


class RankProcess:
    """One rank as a child process (a fresh interpreter, not multiprocessing's spawn, so the caller's script is
    never re-imported)."""

    def __init__(self, args: RankArgs, folder: str) -> None:
        self.rank = args.rank
        args_file = os.path.join(folder, f"rank{args.rank}.pkl")
        with open(args_file, "wb") as f:
            pickle.dump(args, f)
        self.popen = subprocess.Popen([sys.executable, "-m", "radixgen.runtime.scheduler", args_file],
                                      stdin=subprocess.DEVNULL, env=rank_env(os.environ))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited 5 s later."""
        if self.is_alive():
            self.popen.terminate()
            self.join(timeout=5)
        if self.is_alive():
            self.popen.kill()
            self.join(timeout=5)


def first_dead(procs: list[RankProcess]) -> RankProcess | None:
    return next((p for p in procs if not p.is_alive()), None)


class GroupHost:
    """Node 0's meeting point of the group, in the Engine's process (see the module doc)."""

    def __init__(self, cfg: RuntimeConfig, model_config) -> None:
        host, port = split_addr(cfg.dist_init_addr) if cfg.dist_init_addr else ("127.0.0.1", 0)
        self.cfg = cfg
        self.store = group_store.connect_store(host, port, cfg.dist_timeout, is_master=True)
        self.addr = (host, self.store.port)  # port 0 asked for a free one
        self.store.set(group_store.EXPECT_KEY, group_store.fingerprint(cfg, model_config))
        self.started = time.monotonic()

    def check(self) -> None:
        """While the group starts: RuntimeError with the first rank's reported failure, or naming the ranks of
        other nodes that have not joined once dist_timeout has passed (this node's are processes the Engine
        watches: one that dies is reported as such)."""
        store = self.store
        if store.check([group_store.ERROR_KEY]):
            raise RuntimeError(store.get(group_store.ERROR_KEY).decode())
        if time.monotonic() - self.started > self.cfg.dist_timeout:
            local = node_ranks(self.cfg)
            missing = [r for r in range(self.cfg.world_size)
                       if r not in local and not store.check([group_store.joined_key(r)])]
            if missing:
                nodes = sorted({r // (self.cfg.world_size // self.cfg.nnodes) for r in missing})
                raise RuntimeError(f"ranks {missing} (node(s) {nodes}) did not join the group at "
                                   f"{self.addr[0]}:{self.addr[1]} within dist_timeout={self.cfg.dist_timeout:g} s: "
                                   f"start `radixgen serve` there with --node-rank and the same "
                                   f"--dist-init-addr, --nnodes, --tp-size and --pp-size")


def run_node(cfg: RuntimeConfig) -> int:
    """`radixgen serve --node-rank N` (N > 0): this node's ranks, until they exit. One that fails stops the
    others (the group cannot go on without it); SIGTERM / SIGINT stop them all."""
    from radixgen.runtime.loader import model_path_for

    model_path = str(model_path_for(cfg))
    store_addr = split_addr(cfg.dist_init_addr)
    folder = tempfile.mkdtemp(prefix="radixgen-node-")
    ranks = node_ranks(cfg)
    procs: list[RankProcess] = []
    stopping: list[int] = []

    def on_signal(sig: int, frame) -> None:
        stopping.append(sig)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        procs = [RankProcess(RankArgs(cfg, model_path, r, store_addr), folder) for r in ranks]
        print(f"radixgen node {cfg.node_rank}: ranks {ranks.start}-{ranks.stop - 1} started, joining "
              f"{cfg.dist_init_addr}", file=sys.stderr, flush=True)
        while not stopping:
            dead = first_dead(procs)
            if dead is not None and (dead.exitcode != 0 or all(not p.is_alive() for p in procs)):
                if dead.exitcode != 0:
                    print(f"radixgen node {cfg.node_rank}: rank {dead.rank} exited with {dead.exitcode}; "
                          f"stopping the others", file=sys.stderr, flush=True)
                    return 1
                return 0
            time.sleep(POLL_S)
        return 0
    finally:
        for p in procs:
            p.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
