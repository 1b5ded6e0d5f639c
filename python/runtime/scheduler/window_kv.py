"""The window group's slots (ground/window_kv.py), kept by the KV cache manager beside the full group's.

A token is named by its full slot everywhere (the radix tree, the request->slot table); `of[full slot]` is its
window slot, 0 where the window layers no longer keep it. The rules:

  - A running request keeps window slots for its positions from kv_len - W at the start of each step on (the
    step's queries read (p - W, p]); its older ones are freed when it is extended (`extend`).
  - A cached position keeps its window slot while the window pool has room: a hit may end anywhere inside a
    cached path and needs the W positions before its end. When the pool is short, `sweep` frees every cached
    position's window slot but the last W before each hit point (a leaf, a branch, a node a running request
    locked: that request's next step reads those), then eviction takes whole least-recently-used nodes.
  - A prefix hit of length L is usable when the window layers hold [L - W, L) (the full layers hold [0, L) by
    construction): `usable_len` shortens a match to the longest such L. When the request that recomputed a
    shortened hit's tokens inserts them, its window slots fill the tree's holes (`adopt`), so the next hit is
    whole: after a sweep, a prompt sharing a cached path's head up to inside a node is computed once more, then
    hits.
  - Every window slot is free or named by exactly one full slot: free + named == capacity (`invariant`).
"""

from __future__ import annotations

import torch

from radixgen.runtime.ground.kv_pool import SlotAllocator
from radixgen.runtime.scheduler.radix import RadixCache, TreeNode


class WindowSlots:
    def __init__(self, window: int, num_slots: int, table: torch.Tensor, chunk: int, full_table: torch.Tensor,
                 num_full_slots: int) -> None:
        """`num_slots`: the window pool's slots with the padding slot 0; `table`: the window table tensor (rows as
        the full table's: a request's row is the same in both); `chunk`: the largest prefill chunk;
        `full_table`: the request->slot table tensor."""
        self.window, self.chunk = window, chunk
        self.allocator = SlotAllocator(num_slots, table.device)
        self.table, self.full_table = table, full_table
        self.of = torch.zeros(num_full_slots, dtype=torch.int64, device=table.device)
        self.trimmed: dict[int, int] = {}  # table row -> the request's own window slots below are freed

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def held(self) -> int:
        return int((self.of != 0).sum())

    # ------------------------------------------------------------------ hits

    def usable_len(self, slots: torch.Tensor) -> int:
        """The longest L <= len(slots) whose window [L - W, L) has window slots (0 is always usable)."""
        n = slots.numel()
        if n == 0:
            return 0
        holes = torch.zeros(n + 1, dtype=torch.int64)
        holes[1:] = torch.cumsum((self.of[slots] == 0).to(torch.int64).cpu(), 0)  # holes[k]: holes in [0, k)
        ends = torch.arange(n + 1)
        ok = (holes[ends] == holes[(ends - self.window).clamp(min=0)]).nonzero()
        return int(ok[-1])

    # ------------------------------------------------------------------ a request's row

    def admit(self, row: int, slots: torch.Tensor) -> None:
        """A request's row over its cached prefix `slots` (the tree's): the window slots the tree keeps."""
        self.trimmed[row] = slots.numel()
        self.table[row, :slots.numel()] = self.of[slots]

    def rewrite(self, row: int, slots: torch.Tensor) -> None:
        """After the request's tokens moved into the tree (its row now names the tree's full `slots`)."""
        n = slots.numel()
        start = max(0, n - self.window)
        self.table[row, start:n] = self.of[slots[start:]]
        self.trimmed[row] = max(self.trimmed.get(row, 0), n)

    def extend(self, row: int, start: int, full: torch.Tensor, make_room) -> None:
        """Positions [start, start + len(full)) of a request get window slots; its own ones before start - W go.
        `make_room(n)` evicts cached prefixes until n window slots are free (or nothing more can go)."""
        self.trim(row, start)
        n = full.numel()
        if n > self.allocator.available():
            make_room(n)
        w = self.allocator.allocate(n)  # raises naming the shortage when eviction could not free enough
        self.of[full] = w
        self.table[row, start:start + n] = w

    def trim(self, row: int, kv_len: int) -> None:
        """Free the request's own window slots of positions before kv_len - W (it never reads them again)."""
        lo, hi = self.trimmed.get(row, 0), kv_len - self.window
        if hi > lo:
            self.free_full(self.full_table[row, lo:hi])
            self.table[row, lo:hi] = 0
            self.trimmed[row] = hi

    def release(self, row: int) -> None:
        self.trimmed.pop(row, None)

    # ------------------------------------------------------------------ slots

    def free_full(self, full: torch.Tensor) -> None:
        """Full slots going back to their allocator: their window slots (where kept) go back to this one."""
        if not full.numel():
            return
        w = self.of[full]
        self.allocator.free(w[w != 0])
        self.of[full] = 0

    def adopt(self, tree_slots: torch.Tensor, own: torch.Tensor, cached_len: int, already: int) -> None:
        """After inserting a request's tokens, before its duplicates are freed: where the tree holds positions
        [cached_len, already) (its full slots `tree_slots`) without their window slots and the request's `own`
        have them, the tree takes the request's (a shortened hit's holes are filled so)."""
        if already > cached_len:
            t, o = tree_slots[cached_len:already], own[cached_len:already]
            fill = (self.of[t] == 0) & (self.of[o] != 0)
            if bool(fill.any()):
                self.of[t[fill]] = self.of[o[fill]]
                self.of[o[fill]] = 0

    def sweep(self, tree: RadixCache) -> int:
        """Free the window slots of cached positions no hit can use: a node keeps them only for the last W
        positions before the nearest hit point at or below it (a leaf, a branch, a node a running request locked:
        what its next step reads). Returns how many went. A walk of the tree, run when the window pool is short."""
        freed = self.allocator.available()
        order, stack = [], [(tree.root, 0)]
        while stack:  # parents before children
            node, start = stack.pop()
            order.append((node, start))
            stack.extend((c, start + len(node)) for c in node.children.values())
        hit_end: dict[int, int] = {}  # id(node) -> the end of the nearest hit point at or below it
        for node, start in reversed(order):  # children before parents
            end = start + len(node)
            h = end if _hit_point(node) else hit_end[id(next(iter(node.children.values())))]
            hit_end[id(node)] = h
            cut = min(h - self.window - start, len(node))  # the node's positions before h - W
            if len(node) and cut > 0:
                self.free_full(node.handle[:cut])
        return self.allocator.available() - freed

    def evictable(self, tree: RadixCache) -> int:
        """Window slots kept by unlocked tree nodes (eviction can free them): a walk of the tree."""
        total, stack = 0, [tree.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if len(node) and node.lock_ref == 0:
                total += int((self.of[node.handle] != 0).sum())
        return total

    def invariant(self, tree: RadixCache, idle: bool) -> None:
        """free + named == capacity and names distinct; `idle` (no request holds slots): every named window slot
        is a tree node's. RuntimeError naming the first difference."""
        named = self.of[self.of != 0]
        if self.allocator.available() + named.numel() != self.capacity:
            raise RuntimeError(f"window slots: free {self.allocator.available()} + named {named.numel()} != "
                               f"capacity {self.capacity}")
        if named.unique().numel() != named.numel():
            raise RuntimeError("window slots: a window slot named by two full slots")
        in_tree, stack = 0, [tree.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if len(node):
                in_tree += int((self.of[node.handle] != 0).sum())
        if idle and in_tree != named.numel():
            raise RuntimeError(f"window slots: {named.numel()} named, {in_tree} of them by the tree's nodes")


def _hit_point(node: TreeNode) -> bool:
    """A node a prefix hit may end at: a leaf, a branch, or the node a running request locked itself."""
    kids = node.children.values()
    return len(node.children) != 1 or node.lock_ref > sum(c.lock_ref for c in kids)
