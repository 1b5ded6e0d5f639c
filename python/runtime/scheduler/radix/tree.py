"""The radix tree's operations: match, insert, lock / unlock, evict (per tier), namespaces; the contract is the
package's (radix/__init__.py)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from radixgen.runtime.scheduler.radix import views
from radixgen.runtime.scheduler.radix.ledger import TierLedger
from radixgen.runtime.scheduler.radix.nodes import KVLocation, MatchResult, NamespaceKey, Tier, TierHook, TreeNode


class RadixCache:
    def __init__(self, page_size: int = 1, disable: bool = False, device: str | torch.device = "cpu",
                 tiers: TierHook | None = None):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.disable = disable
        self.device = torch.device(device)
        self.tiers = tiers
        self.ledger = TierLedger()
        # Page size 1 looks children up by a bare int: cheaper to hash than a 1-tuple.
        if page_size == 1:
            self.child_key = lambda key, i: key[i]
        else:
            self.child_key = lambda key, i: key[i : i + page_size]
        self.reset()

    def reset(self) -> None:
        """Drop every node. The caller frees (or resets) the slots the tree held; nothing may be locked. Lower-tier
        locations go to `tiers.discard`."""
        if self.ledger.protected:
            raise RuntimeError(f"reset with {self.ledger.protected} locked tokens in the radix cache")
        for leaves in self.ledger.lower_leaves.values():
            for leaf in leaves:  # each lower-tier node is a leaf or above one of its tier
                node = leaf
                while node.tier != Tier.DEVICE and node.parent is not None:
                    self.tiers.discard(node.loc)
                    node.parent, node = None, node.parent
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node((), self._device_loc(self._empty()), None)
        self.ledger = TierLedger()
        self._namespace_keys: dict[TreeNode, NamespaceKey] = {}  # subtree root -> its key under the root

    # ---- queries -------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int] | torch.Tensor, namespace: str | tuple | None = None) -> MatchResult:
        """Longest device-resident prefix of `tokens` (whole pages), and how far lower tiers go on
        (`lower_len`). Splits the last device node when the match ends inside it, and refreshes last-access
        times along the device path. Lock `last_node` before use."""
        key = self._as_key(tokens)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root)
        node = self.namespace_root(namespace, create=False)
        if node is None:
            return MatchResult(self._empty(), self.root)
        tick = self._tick()
        values: list[torch.Tensor] = []  # concatenated once at the end, not per node
        i = 0
        while i < len(key):
            child = node.children.get(self.child_key(key, i))
            if child is None:
                break
            if child.tier:  # not on the device (tier 0)
                return self._result(values, node, views.lower_reach(self, child, key, i))
            n = self.common_len(child.key, key, i)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.handle)
            node = child
            i += n  # after a split the next lookup misses: the next token (page) differs
        return self._result(values, node, 0)

    def _result(self, values: list[torch.Tensor], node: TreeNode, lower_len: int) -> MatchResult:
        if not values:
            return MatchResult(self._empty(), self.root, lower_len)
        return MatchResult(torch.cat(values), node, lower_len)

    def lower_path(self, node: TreeNode, tokens: Sequence[int], start: int) -> list[tuple[TreeNode, int]]:
        """The lower-tier nodes that go on with tokens[start:] below device node `node` (the end of a match of
        `start` tokens), each with how many of its tokens match (whole pages; only the last may match in part).
        Refreshes their last access (a load-back is about to use them), splits and locks nothing."""
        key = self._as_key(tokens)
        out: list[tuple[TreeNode, int]] = []
        i, tick = start, self._tick()
        child = node.children.get(self.child_key(key, i)) if i < len(key) else None
        while child is not None and child.tier != Tier.DEVICE:
            n = self.common_len(child.key, key, i)
            if n == 0:
                break
            child.last_access = tick
            out.append((child, n))
            i += n
            if n < len(child) or i >= len(key):
                break
            child = child.children.get(self.child_key(key, i))
        return out

    def record_hit(self, node: TreeNode) -> None:
        """Count a request that reuses the cached prefix ending at `node` (on every node of the path)."""
        while node is not self.root and node is not None:
            node.hits += 1
            node = node.parent

    @property
    def clock(self) -> int:
        """The logical clock: one tick per match and insert (`TreeNode.last_access` is a reading of it)."""
        return self._clock

    def evictable_size(self) -> int:
        return self.ledger.evictable

    def lower_size(self, tier: int) -> int:
        """Tokens held on a lower tier."""
        return self.ledger.lower_size.get(tier, 0)

    def protected_size(self) -> int:
        return self.ledger.protected

    def total_size(self) -> int:
        return self.ledger.evictable + self.ledger.protected

    def invariant(self) -> None:
        """Check the ledger against a walk of the whole tree (RuntimeError naming the first difference)."""
        self.ledger.invariant(self.root)

    # ---- updates -------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor, namespace: str | tuple | None = None
    ) -> int:
        """Store `tokens` -> `slots` and return how many leading tokens were ALREADY in the tree.

        Only the whole-page prefix L = len(tokens) // page_size * page_size is stored. With
        `prefix = insert(...)`, the tree takes ownership of slots[prefix:L] (copied); the caller keeps
        the rest: slots[:prefix] duplicate what the tree holds (free your own among them, i.e.
        slots[cached_len:prefix] after a match of cached_len tokens), and slots[L:] are the unpaged
        tail. A disabled tree stores nothing and returns 0: the caller frees all its new slots.
        """
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ValueError("slots must be a 1-D tensor of slot indices")
        if slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
            raise ValueError(f"slots must have an integer dtype, got {slots.dtype}")
        key = self._as_key(tokens)
        if len(slots) != len(tokens):
            raise ValueError(f"len(slots)={len(slots)} != len(tokens)={len(tokens)}")
        if self.disable or not key:
            return 0
        node = self.namespace_root(namespace, create=True)
        tick = self._tick()
        i = 0
        taken = None  # where the tree started taking slots for lower-tier nodes (moved back to the device)
        while i < len(key):
            child_key = self.child_key(key, i)
            child = node.children.get(child_key)
            if child is None:
                value = slots[i : len(key)].to(device=self.device, dtype=torch.int64, copy=True)
                self._add_leaf(node, child_key, key[i:], value, tick)
                return i if taken is None else taken
            n = self.common_len(child.key, key, i)
            if child.tier:  # not on the device: everything below is lower-tier too: the caller's slots replace it
                if n < len(child):
                    child = self._split(child, n)
                self._promote(child, slots[i : i + n].to(device=self.device, dtype=torch.int64, copy=True))
                taken = i if taken is None else taken
            elif i + n == len(key):  # the key ends inside (or at the end of) this node
                child.last_access = tick
                return len(key)
            elif n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            node = child
            i += n
        return len(key) if taken is None else taken

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a reference count; pair with `unlock`)."""
        if node.parent is None and node is not self.root:
            raise ValueError(f"lock of {node!r}, which is no longer in the tree (evicted or reset)")
        if node.tier != Tier.DEVICE:
            raise ValueError(f"lock of {node!r}, which is not on the device")
        while node is not self.root:
            if node.lock_ref == 0:
                self.ledger.lock(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of {node!r}, which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.ledger.unlock(node)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least `num_tokens` slots, least-recently-used unlocked leaves first (a leaf: no device child).

        Returns the freed slot indices (int64) for the caller's allocator. Whole nodes go, so it may
        free more than asked; it frees less when fewer tokens are evictable. A parent whose last child
        goes becomes a leaf and a candidate in the same call. Each node goes through `tiers.demote`.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        freed: list[torch.Tensor] = []
        count = 0
        heap = [(n.last_access, n.id, n) for n in self.ledger.leaves]
        heapq.heapify(heap)
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed.append(node.handle)
            count += len(node)
            parent = self._demote_or_drop(node)
            if parent in self.ledger.leaves:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return torch.cat(freed) if freed else self._empty()

    def evict_lower(self, tier: int, num_tokens: int) -> int:
        """`evict` within a lower tier: its least-recently-used leaves go (through `tiers.demote`: further down,
        or dropped) until at least `num_tokens` have left it; returns how many did."""
        if tier == Tier.DEVICE or num_tokens < 0:
            raise ValueError(f"evict_lower(tier={tier}, num_tokens={num_tokens}): a lower tier and a count >= 0")
        leaves = self.ledger.lower_leaves.get(tier, set())
        heap = [(n.last_access, n.id, n) for n in leaves]
        heapq.heapify(heap)
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            count += len(node)
            parent = self._demote_or_drop(node)
            if parent in leaves:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return count

    def namespaces(self) -> list[str | tuple]:
        """The names of the non-default namespaces that hold entries."""
        return [k.name for k in self.root.children if isinstance(k, NamespaceKey)]

    def evict_namespace(self, namespace: str | tuple) -> torch.Tensor:
        """Free every unlocked token of one namespace, whatever its last access; locked paths (and the nodes
        above them) stay. Returns the freed slot indices for the caller's allocator."""
        top = self.namespace_root(namespace, create=False)
        if top is None:
            return self._empty()
        order, stack = [], [top]
        while stack:  # parents before children; reversed below, children go first
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        freed = []
        for node in reversed(order):
            if len(node) and not node.children and node.lock_ref == 0:
                if node.tier == Tier.DEVICE:
                    freed.append(node.handle)
                self._remove_leaf(node)
        return torch.cat(freed) if freed else self._empty()

    # ---- internals -----------------------------------------------------------------------------

    def _as_key(self, tokens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        aligned = len(tokens) // self.page_size * self.page_size
        return tuple(tokens[:aligned])

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _device_loc(self, slots: torch.Tensor) -> KVLocation:
        return KVLocation(Tier.DEVICE, slots)

    def namespace_of(self, subtree_root: TreeNode) -> NamespaceKey | None:
        """The root's key of a namespace subtree root (None for any other node)."""
        return self._namespace_keys.get(subtree_root)

    def _new_node(self, key: tuple[int, ...], loc: KVLocation, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(key, loc, parent, self._clock, self._next_id)

    def namespace_root(self, namespace: str | tuple | None, create: bool) -> TreeNode | None:
        if namespace is None:
            return self.root
        if not isinstance(namespace, (str, tuple)):
            raise ValueError(f"namespace must be a str, a tuple or None, got {type(namespace).__name__}")
        ns_key = NamespaceKey(namespace)
        node = self.root.children.get(ns_key)
        if node is None and create:
            node = self._new_node((), self._device_loc(self._empty()), self.root)
            self.root.children[ns_key] = node
            self._namespace_keys[node] = ns_key
        return node

    def child_with_prefix(self, node: TreeNode, key: tuple[int, ...], i: int) -> TreeNode | None:
        """The child of `node` whose key goes on with key[i:] (a match may end inside the child's first page)."""
        if self.page_size == 1 or len(key) - i >= self.page_size:
            return node.children.get(self.child_key(key, i))
        tail = key[i:]  # shorter than a page: children are keyed by whole pages, so look at each
        return next((c for k, c in node.children.items()
                     if not isinstance(k, NamespaceKey) and c.key[:len(tail)] == tail), None)

    def common_len(self, node_key: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        """Length of the common prefix of node_key and key[start:], rounded down to whole pages."""
        segment = key[start : start + len(node_key)]
        if segment == node_key:  # one C-level comparison for the common whole-node match
            return len(node_key)
        n = 0
        for a, b in zip(node_key, segment, strict=False):
            if a != b:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after n tokens; the new upper node (returned) takes node's place under the parent.

        The lower part keeps its identity so a caller holding it (locked) still covers its whole prefix.
        """
        upper_loc, node.loc = node.loc.split(n)
        upper = self._new_node(node.key[:n], upper_loc, node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        node.parent.children[self.child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[self.child_key(node.key, 0)] = node
        return upper

    def _add_leaf(self, parent: TreeNode, child_key: object, key: tuple[int, ...], value: torch.Tensor,
                  tick: int) -> None:
        leaf = self._new_node(key, self._device_loc(value), parent)
        leaf.last_access = tick
        parent.children[child_key] = leaf
        self.ledger.add_leaf(parent, leaf)

    def _demote_or_drop(self, node: TreeNode) -> TreeNode:
        """An unlocked leaf of its tier leaves that tier: `tiers.demote` moves it down, or it is dropped (with
        anything below it). Returns its parent, which may have become a leaf of its own tier."""
        loc = self.tiers.demote(node) if self.tiers is not None else None
        if loc is None:
            return self._remove_leaf(node)
        lowest = min((c.tier for c in node.children.values()), default=max(Tier))
        if not node.tier < loc.tier <= lowest:
            raise ValueError(f"demote of {node!r} to tier {loc.tier}: it must go down, and not below its "
                             f"children's tier {lowest}")
        self.ledger.leave(node)
        node.loc = loc
        self.ledger.join(node)
        parent = node.parent
        if parent is not self.root and len(parent) and parent.lock_ref == 0 and self.ledger.is_leaf(parent):
            self.ledger.leaves_of(parent.tier).add(parent)
        return parent

    def _promote(self, node: TreeNode, slots: torch.Tensor) -> None:
        """A lower-tier node (unlocked, below a device node) gets device `slots`; its lower copy is discarded."""
        self.tiers.discard(node.loc)
        self.ledger.leave(node)
        node.loc = self._device_loc(slots)
        self.ledger.join(node)
        self.ledger.leaves.discard(node.parent)  # it has a device child now

    def _remove_leaf(self, node: TreeNode) -> TreeNode:
        """Detach an unlocked leaf of its tier, and the lower-tier nodes below it; returns its parent, which may
        have become a leaf itself."""
        parent = node.parent
        del parent.children[self.child_key(node.key, 0)]
        stack = [node]
        while stack:  # with no lower tier, just `node`
            n = stack.pop()
            stack.extend(n.children.values())
            self.ledger.leave(n)
            if n.tier != Tier.DEVICE:
                self.tiers.discard(n.loc)
            n.parent = None
        if not parent.children and parent is not self.root:
            if len(parent) == 0:  # an empty namespace subtree root: drop it, it holds no token
                del self.root.children[self._namespace_keys.pop(parent)]
            elif parent.lock_ref == 0:
                self.ledger.leaves_of(parent.tier).add(parent)
        elif parent is not self.root and len(parent) and parent.lock_ref == 0 and self.ledger.is_leaf(parent):
            self.ledger.leaves_of(parent.tier).add(parent)
        return parent
