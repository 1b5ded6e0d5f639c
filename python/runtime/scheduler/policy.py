"""Admission order: which waiting requests the next extend step considers first.

Policies (RuntimeConfig.schedule_policy): "fcfs" (arrival order), "lpm" (longest cached prefix first) and
"dfs-weight" (walk the tree heaviest subtree first, so requests sharing a cached prefix run together).
Requests waiting past `max_queue_wait_steps` go first whatever the policy (no starvation).
"""

from __future__ import annotations

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.request import Req

# A waiting request that shares at least this many not-yet-cached tokens with one admitted in the
# same step waits a step, so the shared part is computed once and then read from the tree.
SHARED_PREFIX_DEFER_TOKENS = 16
# lpm / dfs-weight match every waiting request each step; past this queue length use fcfs (cost).
MAX_QUEUE_FOR_CACHE_AWARE = 256


class AdmissionPolicy:
    def __init__(self, cfg: RuntimeConfig, kv: KVCacheManager) -> None:
        self.policy = cfg.schedule_policy
        self.max_wait = cfg.max_queue_wait_steps
        self.kv = kv

    def order(self, waiting: list[Req], step_no: int) -> tuple[list[Req], dict[int, int]]:
        """The waiting queue in policy order (requests past the ageing bound first), and the cached prefix
        length of each request (by id) where the ordering measured it (lpm)."""
        aged = [r for r in waiting if step_no - r.arrival_step >= self.max_wait]
        rest = [r for r in waiting if step_no - r.arrival_step < self.max_wait]
        policy = self.policy
        lens: dict[int, int] = {}
        if self.kv.cache_disabled or len(rest) > MAX_QUEUE_FOR_CACHE_AWARE:
            policy = "fcfs"
        if policy == "lpm":
            lens = {id(r): self.kv.cached_prefix_len(r) for r in rest}
            rest.sort(key=lambda r: -lens[id(r)])  # stable: fcfs among equals
        elif policy == "dfs-weight":
            rest = self.dfs_weight_order(rest)
        return aged + rest, lens

    def dfs_weight_order(self, reqs: list[Req]) -> list[Req]:
        """Walk the tree from the root, heaviest subtree (most waiting requests) first, so requests
        that share cached prefixes run next to each other."""
        at_node: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        children: dict[int, list] = {}
        for r in reqs:
            node = self.kv.match(r.radix_key[:r.max_cacheable()], r.namespace).last_node
            at_node.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                parent = node.parent
                if parent is not None and weight[id(node)] == 1:
                    children.setdefault(id(parent), []).append(node)
                node = parent
        out: list[Req] = []
        stack = [self.kv.tree.root]
        while stack:
            node = stack.pop()
            out += at_node.get(id(node), [])
            kids = sorted(children.get(id(node), []), key=lambda n: weight[id(n)])
            stack += kids  # heaviest popped first
        return out

    def shares_uncached_prefix(self, req: Req, admitted: list[Req], cached: int | None = None) -> bool:
        """Whether `req` shares a long not-yet-cached prefix with a request admitted this step (then it waits
        a step and reuses that prefix). `cached`: its cached prefix length if already measured this step; a
        heuristic may use it even if an eviction since shortened the match (admission re-matches).

        Prompts are compared by the tree's keys (`Req.radix_key`), not their ids: an image's placeholder ids are the
        same for every image, its key ids follow its content hash, so requests about one image wait for the first
        one's prefill and read its image's KV from the tree, and requests about different images never wait."""
        if self.kv.cache_disabled:
            return False
        key = req.radix_key
        if cached is None:
            cached = self.kv.cached_prefix_len(req)
        for other in admitted:
            if other.namespace != req.namespace:
                continue
            if common_prefix_len(key, other.radix_key) - cached >= SHARED_PREFIX_DEFER_TOKENS:
                return True
        return False


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
