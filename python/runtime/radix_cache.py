"""The radix tree of the prefix cache: token-id sequences -> KV slot indices.

The tree holds slot indices only (one int64 per token, a tensor per node), never KV data. The caller
owns the allocator: slots enter the tree through `insert` and leave it through `evict`.

Contract, in the order a request uses it:
  1. `m = match_prefix(tokens, namespace)`, then `lock(m.last_node)` before using `m.slots`: an
     unlocked match may be evicted (and its slots reused) by the next `evict`.
  2. `already = insert(tokens, slots, namespace)` when the request (or a prefill chunk) is done;
     `unlock` the node locked in step 1 afterwards (for a chunk: match again and lock the new node).
  3. `evict(n)` frees least-recently-used unlocked leaves first; it may free more than asked (whole
     nodes) and less when not enough is evictable.

Namespaces ("cache salt"; with a LoRA adapter, the tuple (salt, adapter load id)): `None` is the default
namespace, stored directly under the root; every other namespace is a subtree under a child of the root
keyed by `NamespaceKey(name)`. That subtree root has an empty key (it holds no token) and is removed as
soon as its last child is evicted. Requests in different namespaces never share slots; `evict_namespace`
drops one namespace's unlocked entries (an adapter's unload).

With page_size > 1 keys are compared in whole pages: a child is looked up by the token tuple of its
first page, and matches and inserts are rounded down to whole pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class NamespaceKey:
    """The root's child key of a non-default namespace; never equal to a token or a page tuple."""

    name: str | tuple


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` slots (same length).

    `lock_ref` counts the locks held on this node or any node below it; a node with lock_ref > 0
    is never evicted. `last_access` is the tree's logical clock at the last match/insert through it;
    `hits` counts the requests admitted with a cached prefix through it (`record_hit`).
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "hits")

    def __init__(
        self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None, last_access: int, id: int
    ):
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # (len(key),) int64 slot indices
        self.lock_ref = 0
        self.last_access = last_access
        self.id = id  # creation order; breaks LRU ties deterministically
        self.hits = 0

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        head = list(self.key[:8])
        more = "..." if len(self.key) > 8 else ""
        return f"TreeNode(len={len(self.key)}, key={head}{more}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # (n,) int64: the cached prefix's slot indices
    last_node: TreeNode  # covers exactly the matched prefix; the root when n == 0


class RadixCache:
    def __init__(self, page_size: int = 1, disable: bool = False, device: str | torch.device = "cpu"):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.disable = disable
        self.device = torch.device(device)
        self._protected = 0
        # Page size 1 looks children up by a bare int: cheaper to hash than a 1-tuple.
        if page_size == 1:
            self._child_key = lambda key, i: key[i]
        else:
            self._child_key = lambda key, i: key[i : i + page_size]
        self.reset()

    def reset(self) -> None:
        """Drop every node. The caller frees (or resets) the slots the tree held; nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tokens in the radix cache")
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node((), self._empty(), None)
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._protected = 0  # tokens in nodes with lock_ref > 0
        self._leaves: set[TreeNode] = set()  # token nodes with no children and lock_ref == 0
        self._namespace_keys: dict[TreeNode, NamespaceKey] = {}  # subtree root -> its key under the root

    # ---- queries -------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int] | torch.Tensor, namespace: str | tuple | None = None) -> MatchResult:
        """Longest cached prefix of `tokens` (whole pages). Splits the last node when the match ends
        inside it, and refreshes last-access times along the path. Lock `last_node` before use."""
        key = self._as_key(tokens)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root)
        node = self._namespace_root(namespace, create=False)
        if node is None:
            return MatchResult(self._empty(), self.root)
        tick = self._tick()
        values: list[torch.Tensor] = []  # concatenated once at the end, not per node
        i = 0
        while i < len(key):
            child = node.children.get(self._child_key(key, i))
            if child is None:
                break
            n = self._common_len(child.key, key, i)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            node = child
            i += n  # after a split the next lookup misses: the next token (page) differs
        if i == 0:
            return MatchResult(self._empty(), self.root)
        return MatchResult(torch.cat(values), node)

    def continuation(self, tokens: Sequence[int], namespace: str | None = None, max_tokens: int = 8) -> list[int]:
        """Up to `max_tokens` tokens the tree holds right after the whole of `tokens` (what an earlier request
        with this context went on with), along the most recently used branch where it forks; [] when the tree
        does not hold all of `tokens` or nothing follows. Read-only: splits, refreshes and locks nothing."""
        key = tuple(tokens)
        node = None if self.disable or max_tokens <= 0 or not key else self._namespace_root(namespace, create=False)
        if node is None:
            return []
        i, rest = 0, ()  # rest: what follows the context inside the node where it ends
        while i < len(key):
            child = self._child_with_prefix(node, key, i)
            if child is None:
                return []
            n = min(len(child), len(key) - i)
            if child.key[:n] != key[i:i + n]:
                return []
            node, i, rest = child, i + n, child.key[n:]
        out = list(rest[:max_tokens])
        while len(out) < max_tokens:
            branches = [c for k, c in node.children.items() if not isinstance(k, NamespaceKey)]
            if not branches:
                break
            node = max(branches, key=lambda c: (c.last_access, c.id))
            out += node.key[:max_tokens - len(out)]
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
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

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
        node = self._namespace_root(namespace, create=True)
        tick = self._tick()
        i = 0
        while i < len(key):
            child_key = self._child_key(key, i)
            child = node.children.get(child_key)
            if child is None:
                value = slots[i : len(key)].to(device=self.device, dtype=torch.int64, copy=True)
                self._add_leaf(node, child_key, key[i:], value, tick)
                return i
            n = self._common_len(child.key, key, i)
            if i + n == len(key):  # the key ends inside (or at the end of) this node
                child.last_access = tick
                return len(key)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            node = child
            i += n
        return len(key)

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a reference count; pair with `unlock`)."""
        if node.parent is None and node is not self.root:
            raise ValueError(f"lock of {node!r}, which is no longer in the tree (evicted or reset)")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of {node!r}, which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._protected -= len(node)
                if not node.children and len(node):
                    self._leaves.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least `num_tokens` slots, least-recently-used unlocked leaves first.

        Returns the freed slot indices (int64) for the caller's allocator. Whole nodes go, so it may
        free more than asked; it frees less when fewer tokens are evictable. A parent whose last child
        goes becomes a leaf and a candidate in the same call.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        freed: list[torch.Tensor] = []
        count = 0
        heap = [(n.last_access, n.id, n) for n in self._leaves]
        heapq.heapify(heap)
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed.append(node.value)
            count += len(node)
            parent = self._remove_leaf(node)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return torch.cat(freed) if freed else self._empty()

    def namespaces(self) -> list[str | tuple]:
        """The names of the non-default namespaces that hold entries."""
        return [k.name for k in self.root.children if isinstance(k, NamespaceKey)]

    def evict_namespace(self, namespace: str | tuple) -> torch.Tensor:
        """Free every unlocked token of one namespace, whatever its last access; locked paths (and the nodes
        above them) stay. Returns the freed slot indices for the caller's allocator."""
        top = self._namespace_root(namespace, create=False)
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
                freed.append(node.value)
                self._remove_leaf(node)
        return torch.cat(freed) if freed else self._empty()

    # ---- debug ---------------------------------------------------------------------------------

    def pretty_print(self) -> str:
        """Print (and return) the tree, one node per line, indented by depth."""
        lines = [f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, "
                 f"protected={self._protected})"]
        stack = [(child, 1, k) for k, child in reversed(self.root.children.items())]
        while stack:
            node, depth, k = stack.pop()
            label = f"namespace {k.name!r}" if isinstance(k, NamespaceKey) else repr(node)
            lines.append(f"{'  ' * depth}{label} last_access={node.last_access}")
            stack.extend((c, depth + 1, ck) for ck, c in reversed(node.children.items()))
        text = "\n".join(lines)
        print(text)
        return text

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

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(key, value, parent, self._clock, self._next_id)

    def _namespace_root(self, namespace: str | tuple | None, create: bool) -> TreeNode | None:
        if namespace is None:
            return self.root
        if not isinstance(namespace, (str, tuple)):
            raise ValueError(f"namespace must be a str, a tuple or None, got {type(namespace).__name__}")
        ns_key = NamespaceKey(namespace)
        node = self.root.children.get(ns_key)
        if node is None and create:
            node = self._new_node((), self._empty(), self.root)
            self.root.children[ns_key] = node
            self._namespace_keys[node] = ns_key
        return node

    def _child_with_prefix(self, node: TreeNode, key: tuple[int, ...], i: int) -> TreeNode | None:
        """The child of `node` whose key goes on with key[i:] (a match may end inside the child's first page)."""
        if self.page_size == 1 or len(key) - i >= self.page_size:
            return node.children.get(self._child_key(key, i))
        tail = key[i:]  # shorter than a page: children are keyed by whole pages, so look at each
        return next((c for k, c in node.children.items()
                     if not isinstance(k, NamespaceKey) and c.key[:len(tail)] == tail), None)

    def _common_len(self, node_key: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
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
        upper = self._new_node(node.key[:n], node.value[:n], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        node.parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        node.value = node.value[n:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _add_leaf(self, parent: TreeNode, child_key: object, key: tuple[int, ...], value: torch.Tensor,
                  tick: int) -> None:
        leaf = self._new_node(key, value, parent)
        leaf.last_access = tick
        parent.children[child_key] = leaf
        self._evictable += len(leaf)
        self._leaves.discard(parent)
        self._leaves.add(leaf)

    def _remove_leaf(self, node: TreeNode) -> TreeNode:
        """Detach an unlocked leaf; returns its parent, which may have become a leaf itself."""
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        self._leaves.discard(node)
        self._evictable -= len(node)
        node.parent = None
        if not parent.children and parent is not self.root:
            if len(parent) == 0:  # an empty namespace subtree root: drop it, it holds no token
                del self.root.children[self._namespace_keys.pop(parent)]
            elif parent.lock_ref == 0:
                self._leaves.add(parent)
        return parent
