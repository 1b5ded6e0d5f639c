"""An approximate radix tree over prompt text: what the router believes one worker holds in its cache.

It stores characters, not tokens (the router has no tokenizer): a shared text prefix is a shared token
prefix up to the last token boundary, which is as exact as a routing decision needs. It is bounded by its
total number of characters; past the bound the least recently used leaves are dropped first."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

LOW_WATERMARK = 0.9  # evict down to 90% of the bound: one pass frees room for many inserts


class _Node:
    __slots__ = ("label", "children", "parent", "last_access")

    def __init__(self, label: str, parent: _Node | None, now: float):
        self.label = label  # the edge from the parent; "" only at the root
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.parent = parent
        self.last_access = now


def common_len(a: str, b: str, start: int = 0) -> int:
    """Length of the common prefix of a and b[start:]. Slices compare in C: a bisection over
    slice equality beats a Python loop over characters for the long labels this tree holds."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[start : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    def __init__(self, max_chars: int, clock: Callable[[], float] = time.monotonic):
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self.clock = clock
        self.root = _Node("", None, clock())
        self.size = 0  # characters stored: the sum of every edge label's length

    def match_len(self, text: str) -> int:
        """How many leading characters of `text` the tree holds. Read-only: a lookup is not a use."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = common_len(child.label, text, i)
            i += k
            if k < len(child.label):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        """Add `text` and mark its whole path as just used; evicts when over the bound."""
        now = self.clock()
        node, i = self.root, 0
        node.last_access = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                node.children[text[i]] = _Node(text[i:], node, now)
                self.size += len(text) - i
                break
            k = common_len(child.label, text, i)
            if k < len(child.label):  # split: [0, k) becomes a new inner node, [k, len) stays below it
                mid = _Node(child.label[:k], node, now)
                node.children[text[i]] = mid
                child.label = child.label[k:]
                child.parent = mid
                mid.children[child.label[0]] = child
                child = mid
            child.last_access = now
            node, i = child, i + k
        if self.size > self.max_chars:
            self.evict(int(self.max_chars * LOW_WATERMARK))

    def evict(self, target: int) -> int:
        """Drop least recently used leaves until at most `target` characters remain; returns the
        number dropped. An insert touches its whole path, so a node is at least as recent as any node
        below it: taking leaves oldest first drops the least recently used text first."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while self.size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            freed += len(leaf.label)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())
