"""The KV cache manager: the one owner of KV slots.

It owns the radix tree (cached prefixes), the free-slot allocator and the request->slot table's rows, and
checks the idle invariant: free + evictable + protected == total slots. The model runner only holds the K/V
buffers and the table tensor; everything that takes, gives back or records a slot goes through here.

A request's KV, as recorded on its `Req`:
    [0, cached_len)          slots held by the tree under `last_node` (locked while the request holds them)
    [cached_len, kv_len)     slots the request owns (allocated by `extend`, including the positions the step
                             being run computes)
All of [0, kv_len) are listed in its table row. `cache_computed` moves the computed part into the tree,
`release` gives everything back, `free_tail` drops owned positions from the end (rejected speculative tokens,
or a step that failed before computing them).

Eviction goes through the demote hook (`demote` / `discard`, the tree's TierHook): with no lower tier attached
every evicted node is dropped and its slots return to the allocator; with one (`attach_lower_tier`: host memory
or disk) it may take the node's KV instead, and the node stays in the tree on that tier. The hierarchical cache
(tiers/: `hicache`, from --enable-hierarchical-cache / --kv-cache-dir) is that lower tier: it also hears of every
insert (`cached`: write-through to disk), loads prefixes back before admission (waits.KVLoadBack) and splits a
request's cached tokens by the tier they came from.

Window layers (ground/window_kv.py, when the runner keeps a window group): `window` (scheduler/window_kv.py)
keeps their slots beside these, named by the full slots: every full slot freed frees its window slot, a match is
shortened to the longest prefix whose last W tokens the window layers hold, and when the window pool is short the
window slots no hit can use are swept, then whole nodes evicted.

Namespaces: a request's `namespace` (its cache salt, with its LoRA adapter's load id when it has one) keys
its own subtree: requests in different namespaces never share slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from radixgen.runtime.executor.step_messages import KVCopyQueue
from radixgen.runtime.ground.kv_pool import ReqToSlotTable, SlotAllocator, TableWriteLog
from radixgen.runtime.scheduler.radix import KVLocation, MatchResult, RadixCache, TreeNode, views
from radixgen.runtime.scheduler.request import Req
from radixgen.runtime.scheduler.window_kv import WindowSlots

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_slots: int, table: torch.Tensor, page_size: int = 1, disable_cache: bool = False,
                 table_log: TableWriteLog | None = None, copies: KVCopyQueue | None = None,
                 window: tuple[int, int, torch.Tensor, int] | None = None) -> None:
        """`num_slots`: the pool's slots including the padding slot 0; `table`: the request->slot table tensor
        (see kv_pool.new_req_to_slot_table), shared with the model runner, which may ask for its writes to be
        logged in `table_log` (the other ranks of a parallel group keep a copy); `copies`: the runner's queue of
        KV copy orders (None: no runner, copy_slots is refused); `window`: (W, window slots with the padding
        slot, the window table tensor, the largest prefill chunk) where the pool keeps a window group."""
        self.copies = copies
        self.allocator = SlotAllocator(num_slots, table.device)
        self.table = ReqToSlotTable(table, table_log)
        self.lower_tier = None  # what takes evicted nodes' KV (demote / discard); None: they are dropped
        self.hicache = None  # the hierarchical cache (tiers.HierarchicalCache), when it is the lower tier
        self.tree = RadixCache(page_size=page_size, disable=disable_cache, tiers=self)
        self.evicted_tokens = 0
        self.window = None if window is None else WindowSlots(*window, table, num_slots)

    @classmethod
    def for_runner(cls, runner, page_size: int = 1, disable_cache: bool = False) -> KVCacheManager:
        plan = getattr(runner, "window_plan", None)
        window = None if plan is None else (plan.window, runner.kv_pool.window_slots, runner.req_to_wslot,
                                            runner.runtime_config.chunked_prefill_size)
        kv = cls(runner.kv_pool.num_slots, runner.req_to_slot, page_size, disable_cache, runner.table_log,
                 runner.kv_copies, window)
        from radixgen.runtime.scheduler.tiers import HierarchicalCache

        hicache = HierarchicalCache.for_runner(kv, runner)
        if hicache is not None:
            kv.attach_lower_tier(hicache)
            kv.hicache = hicache
        return kv

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def cache_disabled(self) -> bool:
        return self.tree.disable

    # ------------------------------------------------------------------ the tree: match / insert, lock / unlock

    def match(self, tokens: Sequence[int], namespace: str | None = None) -> MatchResult:
        """The longest cached prefix; lock `last_node` before using its slots (an unlocked match may be evicted)."""
        return self.tree.match_prefix(tokens, namespace)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor, namespace: str | None = None) -> int:
        """Give `slots` of `tokens` to the tree; returns how many leading tokens it already held (RadixCache.insert)."""
        return self.tree.insert(tokens, slots, namespace)

    def continuation(self, tokens: Sequence[int], namespace: str | None = None, max_tokens: int = 8) -> list[int]:
        """What the tree holds right after all of `tokens` (RadixCache.continuation): read-only, for drafts."""
        out = views.continuation(self.tree, tokens, namespace, max_tokens)
        cut = next((i for i, t in enumerate(out) if t < 0), len(out))  # a media span's key ids are no tokens
        return out[:cut]

    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def cached_prefix_len(self, req: Req) -> int:
        """How much of the request's prefix the tree holds now (for ordering; admission matches again)."""
        return len(self.usable_match(req.radix_key[:req.max_cacheable()], req.namespace).slots)

    def usable_match(self, tokens: Sequence[int], namespace: str | None) -> MatchResult:
        """`match`, shortened where the window layers do not hold the last W tokens of the match (window_kv.py)."""
        m = self.tree.match_prefix(tokens, namespace)
        if self.window is not None and len(m.slots):
            usable = self.window.usable_len(m.slots)
            if usable < len(m.slots):
                m = self.tree.match_prefix(tokens[:usable], namespace)
        return m

    # ------------------------------------------------------------------ eviction: the demote hook

    def name_adapters(self, digest_of) -> None:
        """`digest_of(load id)`: a LoRA adapter's weights' digest, which names its pages in the disk tier."""
        if self.hicache is not None:
            self.hicache.adapter_digest = digest_of

    def attach_lower_tier(self, tier) -> None:
        """A store below the device pool (an object with the hook's `demote(node)` and `discard(loc)`)."""
        self.lower_tier = tier

    def demote(self, node: TreeNode) -> KVLocation | None:
        """Where an evicted node's KV goes: None drops the node (the only answer without a lower tier), else its
        location on a lower tier, which has copied the KV; either way its device slots go back to the allocator."""
        return None if self.lower_tier is None else self.lower_tier.demote(node)

    def discard(self, loc: KVLocation) -> None:
        """The tree no longer holds a lower-tier location."""
        self.lower_tier.discard(loc)

    # ------------------------------------------------------------------ slots: can_allocate / allocate, free

    def available(self) -> int:
        """Slots that can be handed out now: free ones and the tree's unlocked ones (evicted on demand)."""
        return self.allocator.available() + self.tree.evictable_size()

    def free_slots(self) -> int:
        """Slots free without evicting anything (what speculative drafts may take), in both groups."""
        w = self.window
        return self.allocator.available() if w is None else min(self.allocator.available(), w.allocator.available())

    def can_allocate(self, n: int, running: bool = False) -> bool:
        """Whether n slots can be had. `running`: for a request that runs already (its decode step, its prompt's
        next chunk): the hierarchical cache's holds on queued requests' prefixes yield to it. The window group
        needs n too, but at most a window and a chunk (`n` of an admission counts every queued prompt token:
        the window layers keep a request's last W only)."""
        if running and n > self.available() and self.hicache is not None:
            self.hicache.yield_holds(None)
        if n > self.available():
            return False
        w = self.window
        need = 0 if w is None else min(n, w.window + w.chunk)
        if w is None or w.allocator.available() >= need:
            return True
        w.sweep(self.tree)  # cached window slots no hit can use go first
        return need <= w.allocator.available() + w.evictable(self.tree)

    def allocate(self, n: int) -> torch.Tensor:
        """n free slots, evicting least-recently-used cached prefixes when needed (check can_allocate first)."""
        if not self.allocator.can_allocate(n):
            self._evict(n - self.allocator.available())
        return self.allocator.allocate(n)

    def _evict(self, n: int) -> int:
        """Evict least-recently-used cached prefixes (whole nodes) until n slots came back; how many did."""
        freed = self.tree.evict(n)
        self.evicted_tokens += freed.numel()
        self.free(freed)
        return freed.numel()

    def _window_room(self, n: int) -> None:
        """Sweep the cached window slots no hit can use, then evict cached prefixes, one node at a time, until n
        window slots are free or nothing more can go."""
        self.window.sweep(self.tree)
        while self.window.allocator.available() < n and self._evict(1):
            pass

    def free(self, slots: torch.Tensor) -> None:
        """Full slots back to the allocator (and their window slots to the window group's)."""
        if self.window is not None:
            self.window.free_full(slots)
        self.allocator.free(slots)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Order the KV of pool slots `src` copied into slots `dst` before the next step's forward, on every rank
        of a parallel group (an order of the step: step_messages.KVCopies)."""
        if self.copies is None:
            raise RuntimeError("copy_slots: this KV cache manager has no model runner to copy KV in")
        self.copies.copy_slots(src, dst)

    # ------------------------------------------------------------------ a request: admit / release

    def admit(self, req: Req) -> bool:
        """Match the longest cached prefix, lock it and give the request a table row; False when no row is free."""
        if self.table.available() == 0:
            return False
        m = self.usable_match(req.radix_key[:req.max_cacheable()], req.namespace)
        self.tree.lock(m.last_node)
        if len(m.slots):
            self.tree.record_hit(m.last_node)
        req.last_node = m.last_node
        req.cached_len = req.kv_len = len(m.slots)
        if self.hicache is not None:
            if req.reported_cached < 0:  # its first admission: cached_tokens by tier
                req.cached_details = self.hicache.split(req, req.cached_len)
        req.table_row = self.table.allocate()
        self.table.write(req.table_row, 0, m.slots)
        if self.window is not None:
            self.window.admit(req.table_row, m.slots)
        return True

    def unadmit(self, req: Req) -> None:
        """Undo `admit` of a request that got no slots of its own."""
        if req.kv_len != req.cached_len:
            raise RuntimeError(f"unadmit of {req.rid!r}, which owns {req.kv_len - req.cached_len} slots")
        self.tree.unlock(req.last_node)
        self.table.free(req.table_row)
        if self.window is not None:
            self.window.release(req.table_row)
        req.table_row, req.last_node, req.cached_len, req.kv_len = None, None, 0, 0
        if self.hicache is not None and self.table.available() == self.table.max_reqs:
            self.hicache.yield_holds(req)  # it did not fit and no request runs: what loads hold must not block it

    def extend(self, req: Req, n: int) -> None:
        """Allocate slots for the request's positions [kv_len, kv_len + n) (the step about to run computes them)."""
        if self.hicache is not None:
            self.hicache.extending(req)  # its admission's lock holds a loaded prefix from here on
        slots = self.allocate(n)
        self.table.write(req.table_row, req.kv_len, slots)
        if self.window is not None:
            self.window.extend(req.table_row, req.kv_len, slots, self._window_room)
        req.kv_len += n

    def extend_by_one(self, reqs: list[Req]) -> None:
        """`extend(req, 1)` for every request of a decode step, as one allocation and one table write."""
        slots = self.allocate(len(reqs))
        rows = torch.tensor([r.table_row for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.table.write_cells(rows, cols, slots)
        if self.window is not None:
            for i, r in enumerate(reqs):
                self.window.extend(r.table_row, r.kv_len, slots[i:i + 1], self._window_room)
        for r in reqs:
            r.kv_len += 1

    def free_tail(self, req: Req, n: int) -> None:
        """Give back the slots of the request's last n positions (rejected draft tokens, or positions a failed
        step never computed). Only slots the request owns can go: n <= kv_len - cached_len."""
        if not 0 <= n <= req.kv_len - req.cached_len:
            raise ValueError(f"free_tail({req.rid!r}, {n}): the request owns {req.kv_len - req.cached_len} slots")
        if n:
            self.free(self.table.read(req.table_row, req.kv_len - n, req.kv_len))
            req.kv_len -= n

    def cache_computed(self, req: Req) -> None:
        """Insert the computed part of a running request into the tree and move its lock there."""
        if self.tree.disable:
            return
        tokens = req.radix_key[:req.kv_len]
        slots = self.table.read(req.table_row, 0, req.kv_len)
        already = self.tree.insert(tokens, slots, req.namespace)
        if self.hicache is not None:
            self.hicache.cached(tokens, slots, req.namespace)
        m = self.tree.match_prefix(tokens, req.namespace)
        if self.window is not None:  # the tree takes window slots where it has none
            self.window.adopt(m.slots, slots, req.cached_len, already)
        if already > req.cached_len:  # another request inserted the same tokens meanwhile
            self.free(slots[req.cached_len:already])
        self.table.write(req.table_row, 0, m.slots)
        self.tree.lock(m.last_node)
        self.tree.unlock(req.last_node)
        req.last_node, req.cached_len = m.last_node, len(m.slots)
        if self.window is not None:
            self.window.rewrite(req.table_row, m.slots)

    def release(self, req: Req) -> None:
        """Give everything computed to the tree (or free it), unlock, and free the table row; a load-back it waits
        for ends. Idempotent."""
        if self.hicache is not None and (req.kv_load is not None or req.tier_prefetched or req.tier_hold is not None):
            self.hicache.cancel(req)
        if req.table_row is None:
            return
        slots = self.table.read(req.table_row, 0, req.kv_len)
        already = self.tree.insert(req.radix_key[:req.kv_len], slots, req.namespace)
        if self.hicache is not None:
            self.hicache.cached(req.radix_key[:req.kv_len], slots, req.namespace)
        stored = 0 if self.tree.disable else req.kv_len // self.page_size * self.page_size
        if self.window is not None and stored:
            m = self.tree.match_prefix(req.radix_key[:stored], req.namespace)
            self.window.adopt(m.slots, slots, req.cached_len, already)
        if already > req.cached_len:
            self.free(slots[req.cached_len:already])  # duplicates of what the tree holds
        self.free(slots[max(stored, req.cached_len):req.kv_len])  # not taken by the tree
        self.tree.unlock(req.last_node)
        self.table.free(req.table_row)
        if self.window is not None:
            self.window.release(req.table_row)
        req.table_row, req.last_node, req.cached_len, req.kv_len = None, None, 0, 0

    # ------------------------------------------------------------------ the whole cache

    def flush(self) -> None:
        """Drop every cached prefix (the disk tier's pages stay). Only when no request holds slots (nothing may be
        locked)."""
        if self.hicache is not None:
            self.hicache.dropping = True  # evicted nodes go, not down a tier
        try:
            self.free(self.tree.evict(self.tree.evictable_size()))
            self.tree.reset()
        finally:
            if self.hicache is not None:
                self.hicache.dropping = False

    def evict_namespaces(self, belongs) -> int:
        """Free the unlocked entries of every namespace for which belongs(namespace) holds (an adapter's unload);
        returns how many slots went back to the allocator."""
        freed = [self.tree.evict_namespace(ns) for ns in self.tree.namespaces() if belongs(ns)]
        n = sum(f.numel() for f in freed)
        for f in freed:
            self.free(f)
        self.evicted_tokens += n
        return n

    def close(self) -> None:
        """At shutdown: the hierarchical cache's disk writes finish."""
        if self.hicache is not None:
            self.hicache.close()

    def tier_info(self) -> dict | None:
        """The hierarchical cache's tiers for get_server_info (None: it is off)."""
        return None if self.hicache is None else self.hicache.info()

    def usage(self) -> dict:
        out = {"free": self.allocator.available(), "evictable": self.tree.evictable_size(),
               "protected": self.tree.protected_size(), "total": self.capacity, "page_size": self.page_size}
        if self.window is not None:  # the window group: its free and kept slots, of how many
            w = self.window
            out["window"] = {"window": w.window, "free": w.allocator.available(), "held": w.held(),
                             "total": w.capacity}
        return out

    def invariant_holds(self) -> bool:
        """With no request holding slots: free + evictable + protected == total, nothing locked, every row free, and the
        tree's ledger agrees with its nodes."""
        u = self.usage()
        ok = (u["free"] + u["evictable"] + u["protected"] == u["total"] and u["protected"] == 0
              and self.table.available() == self.table.max_reqs)
        if not ok:
            logger.error("KV slot leak: free %d + evictable %d + protected %d != total %d (or %d table rows "
                         "of %d held)", u["free"], u["evictable"], u["protected"], u["total"],
                         self.table.max_reqs - self.table.available(), self.table.max_reqs)
        try:
            self.tree.invariant()  # the tree's per-tier ledger against a walk of its nodes
            if self.window is not None:
                self.window.invariant(self.tree, idle=True)
        except RuntimeError as e:
            logger.error("%s", e)
            ok = False
        return ok and (self.hicache is None or self.hicache.invariant_holds())
