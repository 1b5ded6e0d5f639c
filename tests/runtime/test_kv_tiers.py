"""The tier seam of the prefix cache: nodes hold KV locations, eviction goes through the KV cache manager's demote
hook. A test-only lower tier (an in-memory dict that copies the pool's K/V rows) shows that demoted nodes keep their
place and key, are not matched as device-resident (but are reported as `lower_len`), move back to the device when
their tokens are inserted again, follow LRU within their tier, and that the idle invariant holds throughout; the
default path (no lower tier) evicts exactly as a tree without the hook."""

from __future__ import annotations

import random

import pytest
import torch

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.ground.kv_pool import KVPool, new_req_to_slot_table
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.radix import KVLocation, RadixCache, Tier, TreeNode
from radixgen.runtime.scheduler.request import GenerateRequest, Req


class DictTier:
    """Host memory for tests: a node's K/V rows copied into a dict under fresh integer names (its handle: a tuple
    of them, one per token). Holds at most `capacity` tokens; a node that does not fit is dropped."""

    def __init__(self, pool: KVPool, capacity: int = 1 << 30, tier: int = Tier.HOST) -> None:
        self.pool, self.capacity, self.tier = pool, capacity, tier
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next_name = 0
        self.discarded: list[KVLocation] = []

    def demote(self, node: TreeNode) -> KVLocation | None:
        if node.tier != Tier.DEVICE or len(self.rows) + len(node) > self.capacity:
            return None
        names = tuple(range(self.next_name, self.next_name + len(node)))
        self.next_name += len(node)
        for name, slot in zip(names, node.slots.tolist(), strict=True):
            self.rows[name] = (self.pool.k_buffers[0][slot].clone(), self.pool.v_buffers[0][slot].clone())
        return KVLocation(self.tier, names)

    def discard(self, loc: KVLocation) -> None:
        self.discarded.append(loc)
        for name in loc.handle:
            del self.rows[name]


def setup(slots: int = 32, capacity: int = 1 << 30):
    kv = KVCacheManager(slots + 1, new_req_to_slot_table(4, 64))
    pool = KVPool(1, slots + 1, 1, 2, torch.float32)
    pool.k_buffers[0].copy_(torch.randn(slots + 1, 1, 2))
    pool.v_buffers[0].copy_(torch.randn(slots + 1, 1, 2))
    tier = DictTier(pool, capacity)
    kv.attach_lower_tier(tier)
    return kv, pool, tier


def nodes(tree: RadixCache) -> list[TreeNode]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def cache(kv: KVCacheManager, tokens: list[int]) -> None:
    """A request computing `tokens` and ending: the tree takes its slots."""
    r = Req(GenerateRequest(f"r{random.random()}", tokens + [0], SamplingParams(max_new_tokens=1)), 0)
    assert kv.admit(r)
    kv.extend(r, len(tokens) - r.kv_len)
    kv.release(r)


def test_demoted_nodes_keep_their_place_and_key_and_are_not_device_matches():
    kv, pool, tier = setup()
    a, b = list(range(100, 108)), list(range(100, 104)) + [7, 8, 9]
    cache(kv, a)
    cache(kv, b)
    kv.match(a)  # a used last: b's own leaf is the least recently used one
    before = {n.key: n.slots.clone() for n in nodes(kv.tree)}
    want = {k: [(pool.k_buffers[0][s].clone(), pool.v_buffers[0][s].clone()) for s in v.tolist()]
            for k, v in before.items()}
    free = kv.allocator.available()
    freed = kv.tree.evict(3)  # b's own leaf goes down first
    assert freed.numel() == 3 and kv.allocator.available() == free  # the caller frees them
    kv.free(freed)
    (low,) = [n for n in nodes(kv.tree) if n.tier == Tier.HOST]
    assert low.key == (7, 8, 9) and low.parent.key == (100, 101, 102, 103) and low.parent.tier == Tier.DEVICE
    m = kv.match(b)
    assert len(m.slots) == 4 and m.lower_len == 3
    assert kv.invariant_holds() and kv.tree.lower_size(Tier.HOST) == 3
    kv.free(kv.tree.evict(kv.tree.evictable_size()))  # everything off the device: the tree keeps every node
    assert {n.key for n in nodes(kv.tree)} == set(before) and all(n.tier == Tier.HOST for n in nodes(kv.tree))
    assert kv.usage()["free"] == kv.capacity and kv.invariant_holds()
    for n in nodes(kv.tree):  # the tier holds each node's K/V as the pool had it
        got = [tier.rows[name] for name in n.loc.handle]
        assert all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(got, want[n.key],
                                                                                       strict=True))
    m = kv.match(a)
    assert len(m.slots) == 0 and m.last_node is kv.tree.root and m.lower_len == 8
    with pytest.raises(ValueError, match="not on the device"):
        kv.lock(low)


def test_inserting_demoted_tokens_brings_them_back_to_the_device():
    kv, _, tier = setup()
    a = list(range(100, 110))
    cache(kv, a)
    kv.free(kv.tree.evict(10))
    cache(kv, a[:6])  # the request recomputed 6 of them: the tree takes its slots, the rest stays on the host
    m = kv.match(a)
    assert len(m.slots) == 6 and m.lower_len == 4 and len(m.last_node) == 6
    assert [len(loc.handle) for loc in tier.discarded] == [6] and len(tier.rows) == 4
    assert kv.invariant_holds() and kv.usage()["evictable"] == 6
    cache(kv, a)
    assert kv.match(a).lower_len == 0 and len(kv.match(a).slots) == 10 and not tier.rows
    assert kv.invariant_holds()


def test_lru_within_a_lower_tier_and_drops_take_the_lower_subtree():
    kv, _, tier = setup()
    old, new = [1, 2, 3], [4, 5, 6]
    cache(kv, old)
    cache(kv, new)
    kv.free(kv.tree.evict(6))
    assert kv.tree.lower_size(Tier.HOST) == 6
    assert kv.tree.evict_lower(Tier.HOST, 1) == 3  # the least recently used node of the tier: `old`
    assert kv.match(old).lower_len == 0 and kv.match(new).lower_len == 3
    assert kv.tree.lower_size(Tier.HOST) == 3 and len(tier.rows) == 3
    # a device node whose lower-tier child is in the way: dropping it (the tier is full) drops the child too
    kv, _, tier = setup(capacity=4)
    cache(kv, [1, 2, 3, 4, 5, 6])
    cache(kv, [1, 2, 3, 9])
    kv.free(kv.tree.evict(3))  # (4, 5, 6) to the host
    kv.free(kv.tree.evict(1))  # (9) to the host: 4 tokens there, full
    kv.free(kv.tree.evict(3))  # (1, 2, 3) does not fit: dropped with both children
    assert not nodes(kv.tree) and not tier.rows and kv.tree.lower_size(Tier.HOST) == 0 and kv.invariant_holds()


def test_a_demote_must_go_down():
    kv, _, _ = setup()
    cache(kv, [1, 2, 3])

    class Upward:
        def demote(self, node):
            return KVLocation(Tier.DEVICE, node.slots)

    kv.attach_lower_tier(Upward())
    with pytest.raises(ValueError, match="must go down"):
        kv.tree.evict(3)


def test_the_default_path_evicts_exactly_as_a_tree_without_the_hook():
    """The KV cache manager's tree (hook attached, no lower tier) against a bare RadixCache over the same random
    inserts, matches, locks and evictions: the same freed slots in the same order, the same tree."""
    rng = random.Random(0)
    kv = KVCacheManager(257, new_req_to_slot_table(4, 64))
    bare = RadixCache()
    next_slot = 1
    for _ in range(300):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        op = rng.random()
        if op < 0.5:
            slots = torch.arange(next_slot, next_slot + len(seq))
            next_slot += len(seq)
            assert kv.tree.insert(seq, slots) == bare.insert(seq, slots)
        elif op < 0.8:
            a, b = kv.tree.match_prefix(seq), bare.match_prefix(seq)
            assert torch.equal(a.slots, b.slots) and a.lower_len == b.lower_len == 0
            if rng.random() < 0.3:
                kv.tree.lock(a.last_node)
                bare.lock(b.last_node)
                kv.tree.unlock(a.last_node)
                bare.unlock(b.last_node)
        else:
            n = rng.randrange(1, 20)
            assert torch.equal(kv.tree.evict(n), bare.evict(n))
        assert kv.tree.evictable_size() == bare.evictable_size()
    assert sorted((n.key, n.slots.tolist()) for n in nodes(kv.tree)) == \
        sorted((n.key, n.slots.tolist()) for n in nodes(bare))


def test_kv_buffers_skip_huge_pages_unless_asked_and_numpy_keeps_its_setting():
    """The pools' buffers are allocated with numpy's huge-page advice off (first writes would wait for the kernel to
    compact memory), the device pool's with it under --kv-huge-pages; numpy's own setting is as it was after."""
    import numpy as np

    from radixgen.runtime.ground import kv_pool

    switch = np._core.multiarray._set_madvise_hugepage
    seen = []
    real = kv_pool._no_huge_pages

    def spy(numpy):
        seen.append(True)
        return real(numpy)

    before = switch(True)
    try:
        kv_pool._no_huge_pages = spy
        kv_pool.KVPool(2, 64, 1, 16, torch.bfloat16, huge_pages=True)  # --kv-huge-pages
        assert not seen
        kv_pool.KVPool(2, 64, 1, 16, torch.bfloat16)
        assert len(seen) == 4  # K and V of each of the 2 layers
        host = kv_pool.HostKVPool(2, 64, 1, 16, torch.bfloat16, torch.int8)
        assert len(seen) == 12  # and the 8-bit tier's scales
        assert switch(True) is True  # restored after each allocation
        assert host.k_buffers[0].abs().sum() == 0
    finally:
        kv_pool._no_huge_pages = real
        switch(before)


@pytest.mark.parametrize("code", [None, torch.int8])
def test_write_rows_in_c_equals_the_torch_path(code, monkeypatch):
    """A disk page's tensors stored into host-tier rows: the one C call leaves every buffer (codes, scales, values)
    bit for bit as the per-buffer torch path does; out-of-range rows are refused."""
    from radixgen.runtime.ground import kv_pool

    src = kv_pool.KVPool(3, 40, 2, 16, torch.bfloat16)
    for b in src.k_buffers + src.v_buffers:
        b.copy_(torch.randn(b.shape).bfloat16())
    pools = [kv_pool.HostKVPool(3, 64, 2, 16, torch.bfloat16, code) for _ in range(2)]
    if code is not None:  # the rows of an 8-bit page: codes and scales, as the tier stores them
        for pool in pools:
            kv_pool.copy_kv_rows(src, torch.arange(1, 17), pool, torch.arange(1, 17))
        page = pools[0].read_rows(torch.arange(1, 17))
    else:
        page = src.read_rows(torch.arange(1, 17))
    dst = torch.randperm(40)[:16] + 21  # past the rows the page came from
    pools[0].write_rows(dst, page)  # C
    monkeypatch.setattr(kv_pool.KVPool, "_c_writes", lambda self, index, rows: None)
    pools[1].write_rows(dst, page)  # torch
    for a, b in zip(pools[0].buffers(), pools[1].buffers(), strict=True):
        assert torch.equal(kv_pool.code_bits(a), kv_pool.code_bits(b))
    monkeypatch.undo()
    with pytest.raises(IndexError, match="rows must lie in"):
        pools[0].write_rows(dst + 100, page)
