"""Read-only views of the radix tree: what follows a context (drafts for speculative decoding), the token chain
of a node (what names its disk pages), a printout. None of them splits, refreshes or locks a node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixgen.runtime.scheduler.radix.nodes import NamespaceKey, TreeNode

if TYPE_CHECKING:
    from radixgen.runtime.scheduler.radix.tree import RadixCache


def continuation(tree: RadixCache, tokens: Sequence[int], namespace: str | None = None,
                 max_tokens: int = 8) -> list[int]:
    """Up to `max_tokens` tokens the tree holds right after the whole of `tokens` (what an earlier request
    with this context went on with), along the most recently used branch where it forks; [] when the tree
    does not hold all of `tokens` or nothing follows. Read-only: splits, refreshes and locks nothing."""
    key = tuple(tokens)
    node = None if tree.disable or max_tokens <= 0 or not key else tree.namespace_root(namespace, create=False)
    if node is None:
        return []
    i, rest = 0, ()  # rest: what follows the context inside the node where it ends
    while i < len(key):
        child = tree.child_with_prefix(node, key, i)
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


def lower_reach(tree: RadixCache, node: TreeNode, key: tuple[int, ...], i: int) -> int:
    """How many tokens of key[i:] the lower-tier path from `node` holds (read-only: no split, no refresh)."""
    start = i
    while node is not None:
        n = tree.common_len(node.key, key, i)
        i += n
        if n < len(node) or i == len(key):
            break
        node = node.children.get(tree.child_key(key, i))
    return i - start


def path_of(tree: RadixCache, node: TreeNode) -> tuple[str | tuple | None, list[int]]:
    """The namespace `node` is in, and the tokens from the start of the sequence to the end of `node`."""
    keys = []
    while len(node):  # up to the root or a namespace's subtree root (both hold no token)
        keys.append(node.key)
        node = node.parent
    ns = tree.namespace_of(node)
    return (ns.name if ns is not None else None), [t for k in reversed(keys) for t in k]


def pretty_print(tree: RadixCache) -> str:
    """Print (and return) the tree, one node per line, indented by depth."""
    lines = [f"RadixCache(page_size={tree.page_size}, evictable={tree.ledger.evictable}, "
             f"protected={tree.ledger.protected})"]
    stack = [(child, 1, k) for k, child in reversed(tree.root.children.items())]
    while stack:
        node, depth, k = stack.pop()
        label = f"namespace {k.name!r}" if isinstance(k, NamespaceKey) else repr(node)
        lines.append(f"{'  ' * depth}{label} last_access={node.last_access}")
        stack.extend((c, depth + 1, ck) for ck, c in reversed(node.children.items()))
    text = "\n".join(lines)
    print(text)
    return text
