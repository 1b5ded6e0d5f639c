"""The radix tree's vocabulary: tiers, KV locations, nodes, the tier hook and match results."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple, Protocol

import torch


class Tier(IntEnum):
    DEVICE = 0  # the KV pool: a handle is a (n,) int64 tensor of slot indices
    HOST = 1  # host memory (a lower tier's handle: a buffer range)
    DISK = 2  # disk files (a lower tier's handle: page names)


class KVLocation(NamedTuple):
    """Where a node's KV lives: its tier and a handle with one entry per token that slices like a sequence
    (`handle[a:b]` is the location of tokens [a, b): a node is split by slicing its handle)."""

    tier: int
    handle: object

    def split(self, n: int) -> tuple[KVLocation, KVLocation]:
        return KVLocation(self.tier, self.handle[:n]), KVLocation(self.tier, self.handle[n:])


class TierHook(Protocol):
    """The owner of the tiers below the device (the KV cache manager)."""

    def demote(self, node: TreeNode) -> KVLocation | None:
        """`node` leaves its tier: None drops it, else its new location on a lower tier (it has copied the KV)."""

    def discard(self, loc: KVLocation) -> None:
        """A lower-tier location the tree no longer holds (its node dropped, or moved back to the device)."""


@dataclass(frozen=True)
class NamespaceKey:
    """The root's child key of a non-default namespace; never equal to a token or a page tuple."""

    name: str | tuple


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives at `loc` (a handle of the same length).

    `lock_ref` counts the locks held on this node or any node below it; a node with lock_ref > 0
    is never evicted (only device nodes are locked). `last_access` is the tree's logical clock at the
    last match/insert through it; `hits` counts the requests admitted with a cached prefix through it
    (`record_hit`).
    """

    # the location as two fields (`loc` puts them together): the hot loops read them as plain attributes
    __slots__ = ("children", "parent", "key", "tier", "handle", "lock_ref", "last_access", "id", "hits")

    def __init__(
        self, key: tuple[int, ...], loc: KVLocation, parent: TreeNode | None, last_access: int, id: int
    ):
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.tier, self.handle = loc  # tier 0: the device (slots)
        self.lock_ref = 0
        self.last_access = last_access
        self.id = id  # creation order; breaks LRU ties deterministically
        self.hits = 0

    @property
    def loc(self) -> KVLocation:
        return KVLocation(self.tier, self.handle)

    @loc.setter
    def loc(self, loc: KVLocation) -> None:
        self.tier, self.handle = loc

    @property
    def slots(self) -> torch.Tensor:
        """(len(key),) int64 slot indices of a device node."""
        if self.tier != Tier.DEVICE:
            raise ValueError(f"{self!r} is not on the device")
        return self.handle

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        head = list(self.key[:8])
        more = "..." if len(self.key) > 8 else ""
        tier = f", tier={self.tier}" if self.tier else ""
        return f"TreeNode(len={len(self.key)}, key={head}{more}, lock_ref={self.lock_ref}{tier})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # (n,) int64: the cached prefix's slot indices
    last_node: TreeNode  # covers exactly the matched prefix; the root when n == 0
    lower_len: int = 0  # tokens after it that lower tiers hold (a load-back would bring them to the device)
