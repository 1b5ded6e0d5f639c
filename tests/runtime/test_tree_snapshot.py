"""The radix tree snapshot of the web console (scheduler/radix/snapshot.py) over a real RadixCache: bounds, the
tree shape (every shown edge's parent is shown), hit counts, and who sees which namespace."""

from __future__ import annotations

import torch

from radixgen.runtime.messages import TreeSnapshotRequest
from radixgen.runtime.scheduler.radix import RadixCache
from radixgen.runtime.scheduler.radix.snapshot import snapshot_reply, snapshot_tree


class CharTokenizer:
    """Token id i decodes to chr(ord('a') + i % 26): previews are checkable by eye and by assert."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _insert(tree: RadixCache, tokens: list[int], namespace=None) -> None:
    start = 1000 * (1 + len(tree.namespaces())) + tree.total_size()
    tree.insert(tokens, torch.arange(start, start + len(tokens)), namespace)


def _req(max_nodes=64, max_depth=12, preview_chars=48, viewer=None) -> TreeSnapshotRequest:
    return TreeSnapshotRequest(1, max_nodes, max_depth, preview_chars, viewer)


def test_shape_sizes_and_previews():
    tree = RadixCache()
    system = list(range(10))
    _insert(tree, system + [20, 21, 22])
    _insert(tree, system + [23, 24])
    _insert(tree, [5, 6])
    snap = snapshot_tree(tree, CharTokenizer(), _req())
    by_text = {n.text: n for n in snap.nodes}
    shared = by_text["abcdefghij"]
    assert shared.parent is None and shared.tokens == 10 and shared.subtree_tokens == 15
    assert by_text["uvw"].parent == shared.id and by_text["uvw"].prefix_len == 10 and by_text["uvw"].depth == 1
    assert by_text["xy"].parent == shared.id
    assert by_text["fg"].subtree_tokens == 2
    assert snap.total_nodes == 4 and snap.total_tokens == tree.total_size() == 17
    assert snap.namespaces == ["default"]
    assert snap.to_json()["truncated"] is False


def test_bounds_keep_the_largest_subtrees_and_their_parents():
    tree = RadixCache()
    for i in range(20):  # 20 branches of growing size under one shared prefix
        _insert(tree, [0, 1, 2] + [100 + i] * (i + 1))
    _insert(tree, [7] * 4)
    snap = snapshot_tree(tree, CharTokenizer(), _req(max_nodes=5, preview_chars=3))
    assert len(snap.nodes) == 5 and snap.to_json()["truncated"] is True
    ids = {n.id for n in snap.nodes}
    assert all(n.parent is None or n.parent in ids for n in snap.nodes)
    root = next(n for n in snap.nodes if n.parent is None)
    assert root.tokens == 3 and root.hidden_children == 20 - 4
    branch_sizes = sorted(n.tokens for n in snap.nodes if n.parent == root.id)
    assert branch_sizes == [17, 18, 19, 20]  # the largest branches win
    assert all(len(n.text) <= 4 for n in snap.nodes)  # 3 characters and an ellipsis
    shallow = snapshot_tree(tree, CharTokenizer(), _req(max_depth=1))
    assert [n.depth for n in shallow.nodes] == [0, 0] and shallow.nodes[0].hidden_children == 20


def test_hits_follow_matches_that_are_recorded():
    tree = RadixCache()
    _insert(tree, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 9])  # splits the edge after 3 tokens
    tree.record_hit(m.last_node)
    tree.record_hit(tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node)
    snap = snapshot_tree(tree, CharTokenizer(), _req())
    hits = {n.text: n.hits for n in snap.nodes}
    assert hits == {"bcd": 2, "efg": 1}


def test_namespaces_per_viewer():
    tree = RadixCache()
    _insert(tree, [1, 2, 3])  # default
    _insert(tree, [4, 5], "key-aaa")  # key a's own namespace
    _insert(tree, [6, 7], "key-aaa/doc")  # key a with a salt
    _insert(tree, [8, 9], "key-bbb")
    _insert(tree, [10, 11], ("key-aaa", 3))  # key a with a LoRA adapter
    mine = snapshot_tree(tree, CharTokenizer(), _req(viewer="key-aaa"))
    assert sorted(n.text for n in mine.nodes) == ["ef", "gh", "kl"]
    assert mine.total_nodes == 3
    assert all("key-" not in label for label in mine.namespaces)  # the salt never travels
    assert "default" in mine.namespaces and "default · adapter #3" in mine.namespaces
    shared = snapshot_tree(tree, CharTokenizer(), _req())
    assert shared.total_nodes == 5 and len(shared.namespaces) == 5
    texts = {n.namespace: n.text for n in shared.nodes}
    assert texts["default"] == "bcd"
    salted = [n for n in shared.nodes if n.namespace.startswith("salt ")]
    assert len(salted) == 4 and all(n.text is None for n in salted)  # salted prefixes are nobody's to read
    assert not any("key-" in label for label in shared.namespaces)


def test_a_failed_snapshot_is_a_reply_not_a_crash():
    class Broken:
        def decode(self, ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    tree = RadixCache()
    _insert(tree, [1, 2, 3])
    reply = snapshot_reply(tree, Broken(), _req())
    assert reply.reply_id == 1 and isinstance(reply.payload, str) and "UnicodeDecodeError" in reply.payload
    assert snapshot_reply(tree, CharTokenizer(), _req()).payload.nodes[0].text == "bcd"
