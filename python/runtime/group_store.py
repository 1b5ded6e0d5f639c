"""The parallel group's meeting point: a torch TCPStore that node 0's Engine hosts and every rank joins (its keys,
the layout every rank must agree on). Shared by the front process (engine/ranks.py: GroupHost writes the
expected layout and watches the ranks join) and the ranks (executor/distributed.py: init checks it), and
GroupError, what either side raises when the group cannot go on."""

from __future__ import annotations

import datetime
import json


class GroupError(RuntimeError):
    """The parallel group cannot go on (a rank died, hung past the timeout, or disagrees on the layout)."""


STORE_PREFIX = "radixgen/"
EXPECT_KEY = STORE_PREFIX + "expect"  # the layout the group expects (the Engine writes it)
ERROR_KEY = STORE_PREFIX + "error"  # the first rank's startup failure, for the Engine to report
STARTED_KEY = STORE_PREFIX + "started"  # rank 0 is ready: the steps begin


def joined_key(rank: int) -> str:
    return f"{STORE_PREFIX}joined/{rank}"


def ready_key(rank: int) -> str:
    return f"{STORE_PREFIX}ready/{rank}"


def fingerprint(cfg, model_config) -> str:
    """What every rank of a group must agree on: the layout and everything that sizes the shared KV slot table
    and the shards. `cfg` a RuntimeConfig, `model_config` the model's ModelConfig (a node may keep the same
    model under another path)."""
    from dataclasses import asdict

    keys = ("tp_size", "pp_size", "ep_size", "nnodes", "max_total_tokens", "max_kv_memory_gb", "max_running_requests",
            "context_length", "load_format", "seed", "disable_cpu_kernels", "disable_cuda_graph", "cuda_graph_max_bs",
            "kv_cache_dtype", "quantization")
    return json.dumps({"config": {k: getattr(cfg, k) for k in keys}, "device": cfg.device.split(":")[0],
                       "dtype": str(cfg.torch_dtype), "model": asdict(model_config)}, sort_keys=True, default=str)


def connect_store(host: str, port: int, timeout_s: float, is_master: bool = False):
    """A torch TCPStore at host:port (the master listens there); clear errors for a taken port or no master."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, None, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if is_master:
            raise GroupError(f"dist_init_addr {host}:{port}: cannot listen there ({e}); is the port taken?") from e
        raise GroupError(f"dist_init_addr {host}:{port}: no group to join there within {timeout_s:g} s ({e}); "
                         f"is node 0 started?") from e
