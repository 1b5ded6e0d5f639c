"""The hierarchical cache: the tiers under the radix tree's device pool, as the KV cache manager's lower tier.

Tier 0 is the KV pool. Tier 1 is host memory (ground.kv_pool.HostKVPool: pinned on CUDA; on the CPU by default the
compact 8-bit format), rows handed out here, named in the tree by their row indices (a node's `KVLocation(HOST,
rows)`). Tier 2 is a directory of page files (disk.DiskStore), content-addressed by the hash of each page's token
chain: the tree does not mirror it; a match that ends where the tree's tiers end looks the following pages up by
name (what lets a restarted server, or another replica, find pages it never held).

Policy:
- a device node evicted from the pool moves to tier 1 (`demote`: a DEVICE_TO_HOST copy order), making room there
  by evicting tier 1's least recently used nodes; a tier-1 node evicted leaves the tree, its pages written to
  tier 2 first with write-back (with write-through every page is written to tier 2 when it is cached, `cached`);
- a request whose prefix reaches tier 1 or 2 waits (waits.KVLoadBack) while its pages come back: tier-2 pages are
  read on the store's threads into tier-1 rows held by the load, then (`load_back`) the tier-1 rows are copied into
  fresh pool slots (HOST_TO_DEVICE orders) and inserted into the tree, before the request's admission, so its
  prefill starts from the whole prefix; other requests step meanwhile. What was loaded (or found in the pool) for
  a queued request is held for it (locked) until it gets slots, so that those admitted before it do not evict it
  again; holds leave room for every held request's prefill, and yield when they would block admission.
The copy orders run at once (the model runner's `apply_kv_copies`): the host tier lives in this process (tensor and
pipeline parallelism are refused with it), and running them before the slots they read are reused keeps every
order's source valid.
"""

from __future__ import annotations

import logging

import torch

from radixgen.kernels.kv_quant import quantize_kv_ref
from radixgen.runtime.executor.step_messages import CopyDirection
from radixgen.runtime.ground.kv_pool import HostKVPool, KVPool, SlotAllocator, one_thread
from radixgen.runtime.scheduler.radix import KVLocation, Tier, TreeNode, views
from radixgen.runtime.scheduler.tiers.disk import DiskStore, Page, page_names
from radixgen.runtime.scheduler.tiers.names import STAY, disk_namespace, fingerprint

logger = logging.getLogger(__name__)

MAX_LOAD_WAIT = 64  # polls (steps) a load waits for pool room before it loads what fits


class Load:
    """A request's load-back in progress: what the tree's tiers held at planning, and the disk pages being read into
    tier-1 rows `rows` (held by the load until it ends)."""

    def __init__(self, key: list[int], namespace, host_len: int, rest: int) -> None:
        self.key, self.namespace, self.host_len = key, namespace, host_len
        self.rest = rest  # pool slots the request needs beyond its device prefix (the load and its prefill)
        self.polls = 0
        self.disk_start = 0  # position of the first disk page
        self.rows = None  # (pages * page_size,) tier-1 rows the pages are read into
        self.future = None
        self._read = None

    def ready(self) -> bool:
        return self.future is None or self.future.done()

    def pages_read(self) -> int:
        """Once ready: how many leading pages the reads brought (blocks until then)."""
        if self.future is None:
            return 0
        if self._read is None:
            try:
                self._read = self.future.result()
            except Exception:  # noqa: BLE001 - a failed read is a miss
                logger.exception("reading KV pages from the disk tier failed")
                self._read = 0
        return self._read


class HierarchicalCache:
    def __init__(self, kv, pool: KVPool, host: HostKVPool, copies, apply_copies, write_policy: str = "write_back",
                 disk: DiskStore | None = None) -> None:
        self.kv, self.tree = kv, kv.tree
        self.pool, self.host = pool, host
        self.copies, self.apply_copies = copies, apply_copies
        self.rows = SlotAllocator(host.num_slots)  # tier-1 rows (row 0 is never handed out)
        self.write_through = write_policy == "write_through"
        self.write_policy = write_policy
        self.disk = disk
        self.page_size = kv.page_size
        self.staged = 0  # tier-1 rows held by loads (disk pages read into them)
        self.prefetched = 0  # pool tokens loaded back for requests not admitted yet
        self.reserved = 0  # pool slots the prefills of held requests (self.held: id -> req) will need
        self.held: dict[int, object] = {}
        self.paused = False  # holds were yielded: no load until a request is admitted or none runs
        self.orphans: list[Load] = []  # loads of ended requests whose reads are still running
        self.dropping = False  # flush: evicted nodes are dropped, not moved down
        self.adapter_digest = None  # LoRA load id -> the digest of its weights (the LoRA manager's digest_of)
        self.counts = dict(host_hit_tokens=0, disk_hit_tokens=0, demoted_tokens=0, host_evicted_tokens=0,
                           dropped_tokens=0, loads=0, holds_yielded=0)

    @classmethod
    def for_runner(cls, kv, runner) -> HierarchicalCache | None:
        cfg = runner.runtime_config
        if getattr(runner, "host_pool", None) is None:
            return None
        disk = None
        if cfg.kv_cache_dir is not None:
            disk = DiskStore(cfg.kv_cache_dir, fingerprint(runner, kv.page_size), int(cfg.hicache_disk_size * 2**30))
        return cls(kv, runner.kv_pool, runner.host_pool, runner.kv_copies, runner.apply_kv_copies,
                   cfg.hicache_write_policy, disk)

    @property
    def fingerprint(self) -> str:
        return self.disk.fingerprint if self.disk is not None else ""

    # ------------------------------------------------------------------ the tree's hook: demote / discard

    def demote(self, node: TreeNode) -> KVLocation | None:
        if node.tier == Tier.DEVICE:
            rows = None if self.dropping else self._host_rows(len(node))
            if rows is None:
                self.counts["dropped_tokens"] += len(node)
                return None
            self._copy(CopyDirection.DEVICE_TO_HOST, node.slots, rows)
            self.counts["demoted_tokens"] += len(node)
            return KVLocation(Tier.HOST, rows)
        self.counts["host_evicted_tokens"] += len(node)
        if self.disk is not None and not self.write_through and not self.dropping:
            self._write_node(node)  # write-back: its pages go to disk as it leaves tier 1
        return None  # tier 2 is content-addressed: the node leaves the tree

    def discard(self, loc: KVLocation) -> None:
        if loc.tier == Tier.HOST:
            self.rows.free(loc.handle)

    def _host_rows(self, n: int) -> torch.Tensor | None:
        """n tier-1 rows, evicting tier 1's least recently used nodes for them; None when they cannot be had."""
        if n > self.rows.capacity - self.staged:
            return None
        if not self.rows.can_allocate(n):
            self.tree.evict_lower(Tier.HOST, n - self.rows.available())
        return self.rows.allocate(n) if self.rows.can_allocate(n) else None

    def _copy(self, direction: CopyDirection, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.copies.order(direction, src, dst)
        self.apply_copies()

    # ------------------------------------------------------------------ writes to tier 2

    def cached(self, tokens, slots: torch.Tensor, namespace) -> None:
        """Write-through: the whole pages of `tokens` (whose KV is in pool `slots`) that the disk tier lacks go to
        it now (their rows copied out here, written on the writer thread)."""
        disk, p = self.disk, self.page_size
        if disk is None or not self.write_through or not disk.enabled:
            return
        ns = disk_namespace(namespace, self.adapter_digest)
        if ns is STAY:
            return
        names = page_names(disk.fingerprint, ns, tokens, p)
        todo = [i for i, name in enumerate(names) if not disk.known(name) and not disk.has(name)]
        if not todo:
            return
        index = torch.cat([slots[i * p:(i + 1) * p] for i in todo])
        rows = self._host_format(self.pool.read_rows(index))
        for k, i in enumerate(todo):
            disk.write(Page(names[i], names[i - 1] if i else "", list(tokens[i * p:(i + 1) * p]),
                            [r[k * p:(k + 1) * p] for r in rows]))

    def _write_node(self, node: TreeNode) -> None:
        namespace, tokens = views.path_of(self.tree, node)
        ns = disk_namespace(namespace, self.adapter_digest)
        if ns is STAY or not self.disk.enabled:
            return
        p, start = self.page_size, len(tokens) - len(node)
        names = page_names(self.disk.fingerprint, ns, tokens, p)
        rows = self.host.read_rows(node.handle)
        for i in range(start // p, len(names)):
            a = i * p - start
            self.disk.write(Page(names[i], names[i - 1] if i else "", list(tokens[i * p:(i + 1) * p]),
                                 [r[a:a + p] for r in rows]))

    def _host_format(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pool rows (`KVPool.read_rows`) in the host tier's format: as they are, or quantized to its codes."""
        if self.host.format == self.pool.format:
            return rows
        with one_thread():
            codes, scales = zip(*(quantize_kv_ref(r, self.host.code_dtype) for r in rows), strict=True)
        return [*codes, *scales]

    # ------------------------------------------------------------------ load-back

    def plan(self, req) -> Load | None:
        """What of the request's prefix lower tiers hold past the pool: tier-1 nodes of the tree, then the pages
        tier 2 has; their reads start now (into tier-1 rows). None: nothing to load."""
        self._reap()
        key = req.radix_key[:req.max_cacheable()]
        ns = req.namespace
        m = self.tree.match_prefix(key, ns)
        path = self.tree.lower_path(m.last_node, key, len(m.slots))  # refreshed: tier 1's LRU keeps them
        load = Load(key, ns, sum(n for _, n in path), len(key) + 1 - len(m.slots))
        reach = len(m.slots) + load.host_len
        disk, p = self.disk, self.page_size
        dns = disk_namespace(ns, self.adapter_digest) if disk is not None else STAY
        if disk is not None and disk.enabled and dns is not STAY and reach + p <= len(key):
            names = page_names(disk.fingerprint, dns, key, p)
            run, room = [], (self.rows.capacity - self.staged) // p  # pages tier 1 could take for this load
            for i in range(reach // p, len(names)):
                if len(run) == room or not disk.has(names[i]):
                    break
                run.append(i)
            rows = self._host_rows(len(run) * p) if run else None
            if rows is not None:
                self.staged += rows.numel()
                load.rows, load.disk_start = rows, run[0] * p
                host = self.host

                def sink(j: int, tensors: list[torch.Tensor]) -> None:  # on a reader thread: rows held by this load
                    host.write_rows(rows[j * p:(j + 1) * p], tensors)

                load.future = disk.read([names[i] for i in run], [names[i - 1] if i else "" for i in run],
                                        [key[i * p:(i + 1) * p] for i in run], sink)
        if not load.host_len and load.future is None:
            if not len(m.slots) or self._paused():
                return None
            self._hold(req, m.last_node, 0, load.rest)  # on the device now: held there until its admission
            if req.tier_hold is not None:
                return None
            # no room to hold it now: the wait goes on, so that what is evicted meanwhile is loaded back then
        return load

    def _hold(self, req, node: TreeNode, loaded: int, reserve: int) -> None:
        """Lock the request's prefix under `node` until it gets slots (`extending`) or ends, if room stays for every
        held request's prefill (`reserve`: this one's); `loaded`: its tokens from lower tiers (prefetch budget)."""
        self.admitted(req)  # a retracted request loading again: its earlier hold ends
        self.tree.lock(node)
        if self.reserved + reserve > self.kv.available():
            self.tree.unlock(node)  # not held: the holds must leave room for every held request's prefill
            return
        req.tier_hold, req.tier_prefetched, req.tier_reserved = node, loaded, reserve
        self.prefetched += loaded
        self.reserved += reserve
        self.held[id(req)] = req

    def may_load(self, load: Load) -> bool:
        """Whether the pool may take this load now: the request (its load and its prefill) fits beside what running
        requests lock and what held ones count on (`reserved`), within the budget of loads for queued requests
        (half the pool, or one at a time). After MAX_LOAD_WAIT polls it loads what fits."""
        if self._paused():
            return False
        load.polls += 1
        if load.polls > MAX_LOAD_WAIT:
            return True
        need = load.host_len + (load.pages_read() * self.page_size if load.future is not None else 0)
        budget = self.prefetched == 0 or self.prefetched + need <= self.kv.capacity // 2
        if not budget:
            return False
        m = self.tree.match_prefix(load.key, load.namespace)
        self.tree.lock(m.last_node)  # the room beside its device prefix (held with the load)
        room = self.kv.available()
        self.tree.unlock(m.last_node)
        return load.rest + self.reserved <= room

    def admitted(self, req) -> None:
        """The request gets slots of its own, its prefix under its admission's lock (or it ended, or loads again):
        its loaded tokens leave the prefetch budget, and its reservation ends."""
        self.prefetched -= req.tier_prefetched
        req.tier_prefetched = 0
        self.reserved -= req.tier_reserved
        req.tier_reserved = 0
        self.held.pop(id(req), None)
        if req.tier_hold is not None:
            node, req.tier_hold = req.tier_hold, None
            self.tree.unlock(node)

    def extending(self, req) -> None:
        """The request gets slots: its hold ends (`admitted`); loads may go on after a yield."""
        self.paused = False
        if req.tier_hold is not None or req.tier_prefetched:
            self.admitted(req)

    def _paused(self) -> bool:
        """After a yield, until a request gets slots; never while no request runs (else nothing could lift it)."""
        self.paused = self.paused and self.kv.table.available() < self.kv.table.max_reqs
        return self.paused

    def yield_holds(self, req) -> None:
        """`req` could not be admitted while none runs, or (req None) a running request needs slots the holds
        keep: every other hold ends, so their prefixes may be evicted (and loaded or computed again later).
        Keeps the holds from ever blocking the scheduler."""
        others = [r for r in self.held.values() if r is not req]
        for other in others:
            self.admitted(other)
        if others:
            self.paused = True  # no new load (and hold) until some request has got slots
            self.counts["holds_yielded"] += 1

    def load_back(self, req, load: Load) -> None:
        """Bring the planned prefix into the pool and the tree (as far as it is still there and fits)."""
        try:
            self._load_back(req, load)
        finally:
            self._release(load)

    def _load_back(self, req, load: Load) -> None:
        key, ns, p = load.key, load.namespace, self.page_size
        read = load.pages_read() * p
        m = self.tree.match_prefix(key, ns)
        dev = len(m.slots)
        self.tree.lock(m.last_node)  # the device prefix stays while slots are allocated below
        try:
            host_len = sum(n for _, n in self.tree.lower_path(m.last_node, key, dev))
            d0, d1 = load.disk_start, load.disk_start + read
            disk_len = d1 - (dev + host_len) if d0 <= dev + host_len < d1 else 0
            prefill = max(0, load.rest - host_len - disk_len)  # what it computes, beside the holds of others
            total = min(host_len + disk_len, self.kv.available() - self.reserved - prefill) // p * p
            if total <= 0:
                if dev:
                    self._hold(req, m.last_node, 0, load.rest)
                return
            slots = self.kv.allocate(total)  # may demote other nodes, and evict tier-1 nodes of this path
            path = self.tree.lower_path(m.last_node, key, dev)
            now = min(sum(n for _, n in path), total)
            if now < min(host_len, total):
                disk_len = 0  # the path lost tier-1 nodes: the disk pages no longer follow on
            disk_len = max(0, min(disk_len, total - now))
            used = now + disk_len
            if now:
                src = torch.cat([node.handle[:n] for node, n in path])[:now]
                self._copy(CopyDirection.HOST_TO_DEVICE, src, slots[:now])
            if disk_len:
                skip = dev + now - d0
                self._copy(CopyDirection.HOST_TO_DEVICE, load.rows[skip:skip + disk_len], slots[now:used])
            already = self.tree.insert(key[:dev + used], torch.cat([m.slots, slots[:used]]), ns)
            if already > dev:  # held on the device meanwhile (not possible in one thread; kept exact anyway)
                self.kv.free(slots[:min(already, dev + used) - dev])
            self.kv.free(slots[used:])
            # held for the request until it gets slots of its own: else what is loaded for a queued request is
            # evicted again by the allocations of those admitted before it (measured in the agent benchmark:
            # a third of what was loaded, computed again)
            self._hold(req, self.tree.match_prefix(key[:dev + used], ns).last_node, now + disk_len,
                       max(0, load.rest - now - disk_len))
        finally:
            self.tree.unlock(m.last_node)
        req.tier_loaded = (dev, now, disk_len)
        self.counts["host_hit_tokens"] += now
        self.counts["disk_hit_tokens"] += disk_len
        self.counts["loads"] += 1

    def cancel(self, req) -> None:
        """The request ends before its load-back or its admission: its tier-1 rows go back (once its reads have
        stopped), its loaded tokens leave the prefetch budget."""
        self.admitted(req)
        load, req.kv_load = req.kv_load, None
        if load is not None:
            if load.ready():
                self._release(load)
            else:
                self.orphans.append(load)

    def _release(self, load: Load) -> None:
        if load.rows is not None:
            self.rows.free(load.rows)
            self.staged -= load.rows.numel()
            load.rows = None

    def _reap(self) -> None:
        for load in [o for o in self.orphans if o.ready()]:
            self.orphans.remove(load)
            self._release(load)

    def split(self, req, cached: int) -> dict:
        """cached_tokens by tier for a request admitted with `cached` tokens from the tree: what its load-back
        brought from tiers 1 and 2 (as far as the admission's match still covers it), the rest the pool's."""
        dev, host, disk = getattr(req, "tier_loaded", None) or (cached, 0, 0)
        from_host = max(0, min(cached - dev, host))
        from_disk = max(0, min(cached - dev - host, disk))
        return {"device": cached - from_host - from_disk, "host": from_host, "disk": from_disk}

    # ------------------------------------------------------------------ the whole

    def settle_reads(self) -> None:
        """Wait for every disk read of ended requests (the idle invariant counts their rows as in use until then)."""
        for load in self.orphans:
            load.pages_read()
        self._reap()

    def invariant_holds(self) -> bool:
        self.settle_reads()
        used = self.tree.lower_size(Tier.HOST)
        ok = (self.rows.available() + used + self.staged == self.rows.capacity and self.staged == 0
              and self.prefetched == 0 and self.reserved == 0)
        if not ok:
            logger.error("host tier leak: free %d + in the tree %d + held by loads %d != %d rows (or %d tokens "
                         "counted as prefetched)", self.rows.available(), used, self.staged, self.rows.capacity,
                         self.prefetched)
        return ok

    def info(self) -> dict:
        host = {"capacity_tokens": self.rows.capacity, "used_tokens": self.tree.lower_size(Tier.HOST),
                "free_tokens": self.rows.available(), "format": str(self.host.format).removeprefix("torch."),
                "memory_bytes": self.host.nbytes(), "pinned": self.host.k_buffers[0].is_pinned()}
        return {"write_policy": self.write_policy, "host": host,
                "disk": self.disk.info() if self.disk is not None else None, **self.counts}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

