"""For tests that drive a ModelRunner directly: the runner holds only the KV buffers and the table tensor, so
they take slots and table rows from a KV cache manager, one per runner (as the scheduler owns one)."""

from __future__ import annotations

import weakref

from radixgen.runtime.scheduler.kv_manager import KVCacheManager

_managers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_of(runner) -> KVCacheManager:
    kv = _managers.get(runner)
    if kv is None:
        kv = _managers[runner] = KVCacheManager.for_runner(runner)
    return kv


def check_tiers(kv: KVCacheManager) -> None:
    """The KV invariant in every tier, node by node (with nothing running): each device slot and each host-tier row
    is held by exactly one tree node or free, never both, and the counts add up to each tier's capacity."""
    from radixgen.runtime.scheduler.radix import Tier

    kv.tree.invariant()
    held: dict[int, list[int]] = {Tier.DEVICE: [], Tier.HOST: []}
    stack = list(kv.tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        assert node.tier in held, f"{node!r}: a tier the tree should not hold"
        assert node.lock_ref == 0, f"{node!r} is still locked"
        held[node.tier] += [int(i) for i in node.handle]
    free = kv.allocator._free.tolist()
    dev = held[Tier.DEVICE]
    assert len(set(dev)) == len(dev) and not set(dev) & set(free) and 0 not in dev
    assert len(dev) + len(free) == kv.capacity, (len(dev), len(free), kv.capacity)
    hc = kv.hicache
    if hc is None:
        assert not held[Tier.HOST]
        return
    host, host_free = held[Tier.HOST], hc.rows._free.tolist()
    assert len(set(host)) == len(host) and not set(host) & set(host_free) and 0 not in host
    assert len(host) + len(host_free) == hc.rows.capacity and hc.staged == 0
