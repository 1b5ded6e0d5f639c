"""A bounded, read-only picture of the radix tree for the web console (`/v1/radix_tree`).

The picture holds the `max_nodes` edges with the largest subtrees (in tokens), at most `max_depth` edges deep,
taken best-first from the namespace roots: a parent's subtree is never smaller than its child's, so every edge
shown has its parent shown too and the picture is a tree. Each edge carries its token count, hits, idle time on
the tree's clock and a short decoded preview of its first tokens.

Who sees what (docs/security.md). Under per-key isolation the viewer (an API key's cache namespace) sees only its
own namespaces: its key's and the salts used with it. In a shared cache every namespace is listed, but the text
of a salted namespace is shown to nobody: a salt partitions the cache between clients, who could not probe each
other's prefixes without it. Salts themselves never leave the scheduler: a namespace is labelled by a digest.

Cost: one walk over the whole tree (subtree sizes), then a heap over the shown part; the scheduler answers it
between steps, which a poll every second or two can afford for trees of tens of thousands of edges.
"""

from __future__ import annotations

import hashlib
import heapq
import logging

from radixgen.runtime.messages import ControlReply, TreeNodeView, TreeSnapshot, TreeSnapshotRequest
from radixgen.runtime.scheduler.radix import NamespaceKey, RadixCache, TreeNode

logger = logging.getLogger(__name__)



def snapshot_reply(tree: RadixCache, tokenizer, req: TreeSnapshotRequest) -> ControlReply:
    """The scheduler's answer: the snapshot, or the message of what failed (the Engine raises it as a
    RequestFailed); a picture for the console never takes the scheduler down."""
    try:
        return ControlReply(req.reply_id, snapshot_tree(tree, tokenizer, req))
    except Exception as e:  # noqa: BLE001
        logger.exception("the radix tree snapshot failed")
        return ControlReply(req.reply_id, f"{type(e).__name__}: {e}")


def snapshot_tree(tree: RadixCache, tokenizer, req: TreeSnapshotRequest) -> TreeSnapshot:
    tops = []  # (label, readable, namespace root node) for each namespace the viewer may see
    if req.viewer is None:
        tops.append(("default", True, tree.root))
    for key, node in tree.root.children.items():
        if isinstance(key, NamespaceKey):
            seen = _visibility(key.name, req.viewer)
            if seen is not None:
                tops.append((*seen, node))
    sizes: dict[int, int] = {}  # id(node) -> subtree tokens
    counts = {}  # namespace label -> (edges, tokens)
    for label, _, top in tops:
        edges = _subtree_sizes(top, sizes)
        tokens = sizes[id(top)]
        old = counts.get(label, (0, 0))
        counts[label] = (old[0] + edges, old[1] + tokens)
    heap = []  # (-subtree tokens, node id, node, parent id, depth, prefix len, label, readable)
    for label, readable, top in tops:
        for child in _token_children(top):
            heapq.heappush(heap, (-sizes[id(child)], child.id, child, None, 0, 0, label, readable))
    nodes: list[TreeNodeView] = []
    shown: dict[int, int] = {}  # node id -> children shown so far
    while heap and len(nodes) < req.max_nodes:
        _, _, node, parent, depth, prefix, label, readable = heapq.heappop(heap)
        if parent is not None:
            shown[parent] += 1
        shown[node.id] = 0
        nodes.append(TreeNodeView(
            id=node.id, parent=parent, namespace=label, depth=depth, prefix_len=prefix, tokens=len(node),
            subtree_tokens=sizes[id(node)], hits=node.hits, idle_ticks=tree.clock - node.last_access,
            locked=node.lock_ref > 0, hidden_children=len(node.children),
            text=_preview(tokenizer, node.key, req.preview_chars) if readable else None))
        if depth + 1 < req.max_depth:
            for child in node.children.values():
                heapq.heappush(heap, (-sizes[id(child)], child.id, child, node.id, depth + 1, prefix + len(node),
                                      label, readable))
    nodes = [n if shown[n.id] == 0 else _with_hidden(n, n.hidden_children - shown[n.id]) for n in nodes]
    order = sorted(counts, key=lambda k: -counts[k][1])
    return TreeSnapshot(nodes, sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values()), order,
                        tree.page_size)


def _visibility(name: str | tuple, viewer: str | None) -> tuple[str, bool] | None:
    """(label, text readable) of a namespace for this viewer, or None when it may not see it at all."""
    salt, adapter = (name[0], name[1]) if isinstance(name, tuple) else (name, None)
    suffix = f" · adapter #{adapter}" if adapter is not None else ""
    if viewer is not None:
        if salt == viewer:
            return "default" + suffix, True
        if isinstance(salt, str) and salt.startswith(viewer + "/"):
            return _salt_label(salt) + suffix, True
        return None
    if salt is None:  # a LoRA adapter's requests without a salt: as shared as the default namespace
        return "default" + suffix, True
    return _salt_label(salt) + suffix, False


def _salt_label(salt: str) -> str:
    return "salt " + hashlib.sha256(salt.encode()).hexdigest()[:8]


def _token_children(node: TreeNode) -> list[TreeNode]:
    return [c for k, c in node.children.items() if not isinstance(k, NamespaceKey)]


def _subtree_sizes(top: TreeNode, sizes: dict[int, int]) -> int:
    """Fill sizes[id(node)] with subtree tokens for top and every token edge below it; returns how many edges."""
    order, stack = [], [top]
    while stack:  # iterative: a long chat history is a deep chain
        node = stack.pop()
        order.append(node)
        stack.extend(_token_children(node))
    for node in reversed(order):  # children before parents
        sizes[id(node)] = len(node) + sum(sizes[id(c)] for c in _token_children(node))
    return len(order) - 1


def _preview(tokenizer, key: tuple, chars: int) -> str:
    if tokenizer is None:
        return " ".join(map(str, key[:8]))
    # a token decodes to a character or more: enough of them; a media span's key ids (negative) show as one mark
    ids, text = list(key[:chars]), ""
    while ids:
        cut = next((i for i, t in enumerate(ids) if t < 0), len(ids))
        text += tokenizer.decode(ids[:cut])
        if cut < len(ids):
            text += "[image]"
            ids = ids[cut:]
            ids = ids[next((i for i, t in enumerate(ids) if t >= 0), len(ids)):]
        else:
            ids = []
    return text if len(text) <= chars else text[:chars] + "…"


def _with_hidden(view: TreeNodeView, hidden: int) -> TreeNodeView:
    fields = dict(vars(view))
    fields["hidden_children"] = hidden
    return TreeNodeView(**fields)
