"""The radix tree's tier ledger: per tier, its leaves (the LRU eviction candidates) and its token counts; on the
device, evictable (unlocked) against protected (locked) tokens.

Every tree operation that moves a node between tiers, locks or unlocks it, or adds or removes one, tells the ledger
in the same step; `invariant(root)` recomputes everything from a walk of the tree and names the first difference.
"""

from __future__ import annotations

from radixgen.runtime.scheduler.radix.nodes import Tier, TreeNode


class TierLedger:
    def __init__(self) -> None:
        self.evictable = 0  # device tokens in nodes with lock_ref == 0
        self.protected = 0  # device tokens in nodes with lock_ref > 0
        self.leaves: set[TreeNode] = set()  # device token nodes with no device child and lock_ref == 0
        self.lower_leaves: dict[int, set[TreeNode]] = {}  # lower tier -> its nodes with no child of that tier
        self.lower_size: dict[int, int] = {}  # lower tier -> tokens
        self.lower_total = 0  # tokens on every lower tier (0: the default path, no lower tier in use)

    def leaves_of(self, tier: int) -> set[TreeNode]:
        return self.leaves if tier == Tier.DEVICE else self.lower_leaves.setdefault(tier, set())

    def is_leaf(self, node: TreeNode) -> bool:
        """No child on the node's own tier (children are on the same tier or lower ones)."""
        if not node.children:
            return True
        if not self.lower_total:  # every node is on the device: any child is on the node's tier
            return False
        return all(c.tier != node.tier for c in node.children.values())

    def leave(self, node: TreeNode) -> None:
        """An unlocked `node` leaves its tier (it moves to another one, or out of the tree)."""
        tier = node.tier
        self.leaves_of(tier).discard(node)
        if tier == Tier.DEVICE:
            self.evictable -= len(node)
        else:
            self.lower_size[tier] -= len(node)
            self.lower_total -= len(node)

    def join(self, node: TreeNode) -> None:
        """An unlocked `node` joins the tier its location names."""
        tier = node.tier
        if tier == Tier.DEVICE:
            self.evictable += len(node)
        else:
            self.lower_size[tier] = self.lower_size.get(tier, 0) + len(node)
            self.lower_total += len(node)
        if self.is_leaf(node):
            self.leaves_of(tier).add(node)

    def add_leaf(self, parent: TreeNode, leaf: TreeNode) -> None:
        """A new unlocked device leaf under `parent`, which is no longer a device leaf."""
        self.evictable += len(leaf)
        self.leaves.discard(parent)
        self.leaves.add(leaf)

    def lock(self, node: TreeNode) -> None:
        """`node`'s first lock: its tokens become protected and it stops being an eviction candidate."""
        self.evictable -= len(node)
        self.protected += len(node)
        self.leaves.discard(node)

    def unlock(self, node: TreeNode) -> None:
        """`node`'s last unlock: its tokens become evictable again."""
        self.evictable += len(node)
        self.protected -= len(node)
        if self.is_leaf(node) and len(node):
            self.leaves.add(node)

    def invariant(self, root: TreeNode) -> None:
        """Recompute the ledger from a walk of the tree under `root`; RuntimeError naming the first difference."""
        evictable = protected = 0
        sizes: dict[int, int] = {}
        leaves: dict[int, set[TreeNode]] = {}
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not len(node):  # a namespace's subtree root holds no token
                continue
            if node.tier == Tier.DEVICE:
                if node.lock_ref:
                    protected += len(node)
                    continue
                evictable += len(node)
            else:
                if node.lock_ref:
                    raise RuntimeError(f"radix tree ledger: {node!r} is locked on a lower tier")
                sizes[node.tier] = sizes.get(node.tier, 0) + len(node)
            if all(c.tier != node.tier for c in node.children.values()):
                leaves.setdefault(node.tier, set()).add(node)
        found = {"evictable": evictable, "protected": protected, "lower_total": sum(sizes.values()),
                 "lower_size": {t: n for t, n in sizes.items() if n}, "leaves": leaves.get(Tier.DEVICE, set())}
        kept = {"evictable": self.evictable, "protected": self.protected, "lower_total": self.lower_total,
                "lower_size": {t: n for t, n in self.lower_size.items() if n}, "leaves": self.leaves}
        for tier in set(leaves) | set(self.lower_leaves):
            if tier != Tier.DEVICE:
                found[f"tier {tier} leaves"] = leaves.get(tier, set())
                kept[f"tier {tier} leaves"] = self.lower_leaves.get(tier, set())
        for name, value in found.items():
            if kept[name] != value:
                raise RuntimeError(f"radix tree ledger: {name} is {_show(kept[name])}, the tree holds {_show(value)}")


def _show(value: object) -> str:
    return f"{len(value)} nodes" if isinstance(value, set) else repr(value)
