"""RadixCache: unit tests of each contract, then a state machine against a naive reference model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixgen.runtime.scheduler.radix import MatchResult, NamespaceKey, RadixCache, TreeNode, views


def slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def nodes(cache: RadixCache) -> list[TreeNode]:
    """Every node but the root, depth first."""
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def newest(cache: RadixCache) -> int:
    return max(node.last_access for node in nodes(cache) if len(node))


def check_structure(cache: RadixCache) -> None:
    """Parent links, child keys, lock counts and the size counters agree with the nodes."""
    evictable = protected = 0
    for node in nodes(cache):
        assert node.parent is not None and node in node.parent.children.values()
        assert len(node.slots) == len(node.key)
        assert node.slots.dtype == torch.int64
        for k, child in node.children.items():
            assert child.parent is node
            assert k == cache.child_key(child.key, 0)
            assert node.lock_ref >= child.lock_ref
        if len(node) == 0:  # a namespace subtree root: a child of the root, never empty
            assert node.parent is cache.root and node.children
        else:
            assert len(node) % cache.page_size == 0
        if node.lock_ref > 0:
            protected += len(node)
        else:
            evictable += len(node)
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert cache.total_size() == evictable + protected
    for k, child in cache.root.children.items():
        assert (len(child) == 0) == isinstance(k, NamespaceKey)
    cache.invariant()  # the tier ledger (leaf sets included) against a walk of the tree


# ---- match / split ------------------------------------------------------------------------------


def test_empty_tree_matches_nothing():
    cache = RadixCache()
    m = cache.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert ids(m.slots) == [] and m.slots.dtype == torch.int64
    assert m.last_node is cache.root


def test_partial_match_splits_node():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    m = cache.match_prefix([1, 2, 9])
    assert ids(m.slots) == [10, 11]
    assert m.last_node.key == (1, 2) and ids(m.last_node.slots) == [10, 11]
    (lower,) = m.last_node.children.values()
    assert lower.key == (3, 4) and ids(lower.slots) == [12, 13]
    assert m.last_node.parent is cache.root
    # the whole sequence still matches, through both halves
    full = cache.match_prefix([1, 2, 3, 4, 5])
    assert ids(full.slots) == [10, 11, 12, 13] and full.last_node is lower
    check_structure(cache)


def test_match_shorter_than_node_splits_it():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    m = cache.match_prefix([1, 2, 3])
    assert ids(m.slots) == [0, 1, 2] and m.last_node.key == (1, 2, 3)
    check_structure(cache)


def test_match_accepts_tensor_tokens():
    cache = RadixCache()
    cache.insert(torch.tensor([5, 6, 7]), slots(1, 2, 3))
    assert ids(cache.match_prefix(torch.tensor([5, 6])).slots) == [1, 2]


def test_split_keeps_locked_lower_node_covering_its_prefix():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.last_node)
    cache.match_prefix([1, 2, 7])  # splits the locked node
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    upper = m.last_node.parent
    assert upper.key == (1, 2) and upper.lock_ref == 1
    cache.unlock(m.last_node)
    assert upper.lock_ref == 0 and cache.evictable_size() == 4
    check_structure(cache)


# ---- insert ------------------------------------------------------------------------------------


def test_insert_returns_already_present_prefix():
    cache = RadixCache()
    assert cache.insert([1, 2, 3], slots(0, 1, 2)) == 0
    assert cache.insert([1, 2, 3], slots(5, 6, 7)) == 3  # all duplicates: the tree keeps 0, 1, 2
    assert cache.insert([1, 2, 4, 5], slots(8, 9, 10, 11)) == 2  # tree takes 10, 11
    assert cache.insert([1, 2], slots(0, 1)) == 2
    assert cache.insert([9], slots(12)) == 0
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [0, 1, 2]
    assert ids(cache.match_prefix([1, 2, 4, 5]).slots) == [0, 1, 10, 11]
    assert cache.total_size() == 6
    check_structure(cache)


def test_insert_copies_slots():
    cache = RadixCache()
    row = slots(0, 1, 2)
    cache.insert([1, 2, 3], row)
    row[:] = -1  # the caller reuses its request->slot row
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [0, 1, 2]


def test_insert_rejects_bad_input():
    cache = RadixCache()
    with pytest.raises(ValueError, match="len"):
        cache.insert([1, 2, 3], slots(0, 1))
    with pytest.raises(ValueError, match="dtype"):
        cache.insert([1], torch.tensor([0.0]))
    with pytest.raises(ValueError, match="1-D"):
        cache.insert([1], torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="namespace"):
        cache.insert([1], slots(0), namespace=3)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)


# ---- lock / unlock -----------------------------------------------------------------------------


def test_lock_unlock_reference_counts():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    cache.insert([1, 2, 5], slots(0, 1, 4))
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 5]).last_node
    parent = a.parent
    assert parent is b.parent and parent.key == (1, 2)
    cache.lock(a)
    cache.lock(b)
    cache.lock(b)
    assert (a.lock_ref, b.lock_ref, parent.lock_ref) == (1, 2, 3)
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    cache.unlock(b)
    cache.unlock(a)
    assert (a.lock_ref, b.lock_ref, parent.lock_ref) == (0, 1, 1)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.unlock(b)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(b)
    cache.lock(cache.root)  # an empty match: nothing to protect
    cache.unlock(cache.root)
    check_structure(cache)


# ---- evict -------------------------------------------------------------------------------------


def test_evict_least_recently_used_leaf_first():
    cache = RadixCache()
    cache.insert([1, 1], slots(0, 1))
    cache.insert([2, 2], slots(2, 3))
    cache.insert([3, 3], slots(4, 5))
    cache.match_prefix([1, 1])  # now [2, 2] is the oldest, then [3, 3]
    assert ids(cache.evict(1)) == [2, 3]  # a whole node: more than asked
    assert ids(cache.evict(2)) == [4, 5]
    assert ids(cache.evict(2)) == [0, 1]
    assert cache.total_size() == 0 and ids(cache.evict(5)) == []


def test_lock_of_evicted_node_is_an_error():
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 1))
    m = cache.match_prefix([1, 2])  # not locked: the next evict may take it
    cache.evict(2)
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.lock(m.last_node)


def test_insert_refreshes_lru():
    cache = RadixCache()
    cache.insert([1, 1, 1], slots(0, 1, 2))
    cache.insert([2, 2], slots(3, 4))
    assert cache.insert([1, 1], slots(0, 1)) == 2  # ends inside the node: still a use of it
    assert ids(cache.evict(1)) == [3, 4]


def test_evict_parent_becomes_leaf():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4], slots(0, 1, 3))
    cache.insert([7], slots(9))
    cache.match_prefix([7])  # the [1, 2] subtree is older than [7]
    freed = cache.evict(3)
    # both children of [1, 2] go, then [1, 2] itself before the newer [7]
    assert sorted(ids(freed)) == [0, 1, 2, 3]
    assert ids(cache.match_prefix([7]).slots) == [9]
    assert cache.match_prefix([1, 2]).last_node is cache.root
    check_structure(cache)


def test_evict_never_touches_locked_nodes_or_ancestors():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4], slots(0, 1, 3))
    cache.insert([8, 8], slots(4, 5))
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.last_node)
    cache.match_prefix([1, 2, 4])  # the unlocked sibling is newer than [8, 8]
    freed = cache.evict(100)
    assert sorted(ids(freed)) == [3, 4, 5]  # less than asked: the rest is locked
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [0, 1, 2]
    cache.unlock(m.last_node)
    assert ids(cache.evict(1)) == [2]  # the formerly locked leaf alone is enough
    assert ids(cache.evict(1)) == [0, 1]  # then its parent, a whole node: more than asked
    check_structure(cache)


def test_evict_zero_frees_nothing():
    cache = RadixCache()
    cache.insert([1], slots(0))
    assert ids(cache.evict(0)) == [] and cache.total_size() == 1


# ---- namespaces --------------------------------------------------------------------------------


def test_namespaces_are_isolated():
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    assert cache.match_prefix([1, 2, 3], namespace="a").last_node is cache.root
    assert cache.insert([1, 2, 3], slots(3, 4, 5), namespace="a") == 0
    assert cache.insert([1, 2, 9], slots(3, 4, 6), namespace="b") == 0
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [0, 1, 2]
    assert ids(cache.match_prefix([1, 2, 3], namespace="a").slots) == [3, 4, 5]
    assert ids(cache.match_prefix([1, 2, 3], namespace="b").slots) == [3, 4]
    assert cache.total_size() == 9  # namespace roots hold no token
    check_structure(cache)


def test_empty_namespace_subtree_is_removed():
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 1), namespace="a")
    cache.insert([1, 3], slots(0, 2), namespace="a")
    assert NamespaceKey("a") in cache.root.children
    assert sorted(ids(cache.evict(10))) == [0, 1, 2]
    assert cache.root.children == {} and cache.total_size() == 0
    assert cache.match_prefix([1, 2], namespace="a").last_node is cache.root
    assert cache.insert([1, 2], slots(5, 6), namespace="a") == 0  # recreated on demand
    check_structure(cache)


def test_evict_namespace_frees_that_namespace_only_and_keeps_locked_paths():
    """An adapter's unload: every unlocked entry of its namespaces (tuples, as the LoRA manager keys them) goes,
    whatever its recency; locked paths and every other namespace stay."""
    cache = RadixCache()
    lora = (None, 7)
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3), namespace=lora)
    cache.insert([1, 2, 5], slots(0, 1, 4), namespace=lora)
    cache.insert([1, 2, 9], slots(5, 6, 7), namespace=lora)
    cache.insert([1, 2, 3], slots(10, 11, 12))  # the base model's entries, and another adapter's
    cache.insert([1, 2, 3], slots(13, 14, 15), namespace=(None, 8))
    held = cache.match_prefix([1, 2, 5], namespace=lora).last_node
    cache.lock(held)
    assert sorted(cache.namespaces(), key=str) == [(None, 7), (None, 8)]
    assert sorted(ids(cache.evict_namespace(lora))) == [2, 3, 7]  # [1, 2] and [5] stay under the lock
    assert ids(cache.match_prefix([1, 2, 5], namespace=lora).slots) == [0, 1, 4]
    assert ids(cache.match_prefix([1, 2, 3, 4], namespace=lora).slots) == [0, 1]
    assert ids(cache.match_prefix([1, 2, 3]).slots) == [10, 11, 12]
    assert ids(cache.match_prefix([1, 2, 3], namespace=(None, 8)).slots) == [13, 14, 15]
    check_structure(cache)
    cache.unlock(held)
    assert sorted(ids(cache.evict_namespace(lora))) == [0, 1, 4]
    assert cache.namespaces() == [(None, 8)] and ids(cache.evict_namespace(("x", 1))) == []
    check_structure(cache)


def test_match_in_missing_namespace_creates_nothing():
    cache = RadixCache()
    cache.match_prefix([1, 2], namespace="z")
    assert cache.root.children == {}


# ---- pages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [2, 4])
def test_pages_round_down(page_size):
    cache = RadixCache(page_size=page_size)
    tokens = list(range(2 * page_size + 1))  # two whole pages and one token
    assert cache.insert(tokens, torch.arange(100, 100 + len(tokens))) == 0
    assert cache.total_size() == 2 * page_size  # the tail token stays with the caller
    m = cache.match_prefix(tokens)
    assert ids(m.slots) == list(range(100, 100 + 2 * page_size))
    # diverging in the middle of the second page: only the first page matches, the split is page-aligned
    other = tokens[: page_size + 1] + [99] * page_size
    m = cache.match_prefix(other)
    assert ids(m.slots) == list(range(100, 100 + page_size))
    assert len(m.last_node) == page_size
    assert cache.insert(other, torch.arange(200, 200 + len(other))) == page_size
    assert ids(cache.match_prefix(other).slots) == list(range(100, 100 + page_size)) + list(
        range(200 + page_size, 200 + 2 * page_size)
    )
    assert cache.match_prefix(tokens[: page_size - 1]).last_node is cache.root  # less than a page
    assert cache.insert(tokens[: page_size - 1], torch.arange(page_size - 1)) == 0
    check_structure(cache)


def test_pages_child_lookup_uses_the_whole_first_page():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    cache.insert([1, 5, 6, 7], slots(4, 5, 6, 7))  # same first token, different first page
    assert set(cache.root.children) == {(1, 2), (1, 5)}
    assert ids(cache.match_prefix([1, 5, 6, 7]).slots) == [4, 5, 6, 7]
    check_structure(cache)


# ---- disable / reset / debug -------------------------------------------------------------------


def test_disabled_cache_stores_nothing():
    cache = RadixCache(disable=True)
    assert cache.insert([1, 2, 3], slots(0, 1, 2)) == 0
    m = cache.match_prefix([1, 2, 3])
    assert ids(m.slots) == [] and m.last_node is cache.root
    cache.lock(m.last_node)
    cache.unlock(m.last_node)
    assert ids(cache.evict(10)) == [] and cache.total_size() == 0
    with pytest.raises(ValueError, match="len"):
        cache.insert([1, 2], slots(0))


def test_reset_drops_everything_and_refuses_while_locked():
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 1))
    cache.insert([1, 2], slots(0, 1), namespace="a")
    m = cache.match_prefix([1, 2])
    cache.lock(m.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(m.last_node)
    cache.reset()
    assert cache.total_size() == 0 and cache.root.children == {}
    assert cache.match_prefix([1, 2]).last_node is cache.root
    assert ids(cache.evict(10)) == []


def test_pretty_print(capsys):
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([4], slots(3), namespace="salt")
    text = views.pretty_print(cache)
    assert "namespace 'salt'" in text and "key=[1, 2, 3]" in text
    assert capsys.readouterr().out.strip() == text


# ---- the state machine -------------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=12)
NAMESPACES = st.sampled_from([None, "a"])
# (namespace, tokens, base, cut): with base >= 0, a prefix of an earlier sequence + tokens, so that
# queries hit the tree (and split its nodes) far more often than random sequences would
QUERIES = st.tuples(NAMESPACES, TOKENS, st.integers(-1, 30), st.integers(0, 12))


class CacheMachine(RuleBasedStateMachine):
    """The tree against a flat reference: {(namespace, page-aligned prefix) -> that prefix's last page
    of slots}. The reference is prefix-closed, so the longest match is the longest stored prefix.

    Slots come from a model allocator that reuses freed slots first, so a slot the tree still
    referenced after freeing it would show up as a mismatch or a duplicate.
    """

    @initialize(page_size=st.sampled_from([1, 1, 2, 3]), disable=st.sampled_from([False] * 7 + [True]))
    def build(self, page_size, disable):
        self.cache = RadixCache(page_size=page_size, disable=disable)
        self.page = page_size
        self.ref: dict[tuple, tuple[int, ...]] = {}
        self.free: set[int] = set()
        self.next_slot = 0
        self.in_tree: set[int] = set()
        self.pending: list[tuple] = []  # requests: (ns, tokens, slots, cached_len, last_node)
        self.locks: list[tuple] = []  # bare locks: (ns, matched tokens, last_node)
        self.seen: list[tuple] = []  # (ns, tokens) of every insert so far

    # -- model helpers --

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                s = min(self.free)
                self.free.remove(s)
            else:
                s, self.next_slot = self.next_slot, self.next_slot + 1
            out.append(s)
        return out

    def give_back(self, freed: list[int]) -> None:
        assert len(set(freed)) == len(freed), f"slot freed twice in one call: {freed}"
        for s in freed:
            assert s not in self.free, f"slot {s} freed twice"
            assert s not in self.in_tree, f"slot {s} freed while the tree holds it"
            self.free.add(s)

    def ref_match(self, ns, tokens) -> list[int]:
        out: list[int] = []
        if self.cache.disable:
            return out
        for end in range(self.page, len(tokens) + 1, self.page):
            page = self.ref.get((ns, tuple(tokens[:end])))
            if page is None:
                break
            out.extend(page)
        return out

    def ref_insert(self, ns, tokens, slots) -> int:
        """The reference's insert; returns the prefix that was already present."""
        if self.cache.disable:
            return 0
        already = None
        for end in range(self.page, len(tokens) + 1, self.page):
            k = (ns, tuple(tokens[:end]))
            if k in self.ref:
                assert already is None, "reference lost prefix-closure"
                continue
            if already is None:
                already = end - self.page
            self.ref[k] = tuple(slots[end - self.page : end])
            self.in_tree.update(self.ref[k])
        return len(tokens) // self.page * self.page if already is None else already

    def protected_keys(self) -> set[tuple]:
        held = [(ns, toks[:n]) for ns, toks, _, n, _ in self.pending]
        held += [(ns, toks) for ns, toks, _ in self.locks]
        return {(ns, tuple(t[:end])) for ns, t in held for end in range(self.page, len(t) + 1, self.page)}

    def query(self, q) -> tuple[str | None, list[int]]:
        ns, tokens, base, cut = q
        if base >= 0 and self.seen:
            ns, prefix = self.seen[base % len(self.seen)]
            tokens = prefix[:cut] + tokens
        return ns, tokens

    def check_touched(self, ns, tokens) -> None:
        """After an insert, every node along `tokens` is the most recently used."""
        node = self.cache.root if ns is None else self.cache.root.children.get(NamespaceKey(ns))
        i, end = 0, len(tokens) // self.page * self.page
        while node is not None and i < end:
            node = node.children.get(tokens[i] if self.page == 1 else tuple(tokens[i : i + self.page]))
            if node is not None:
                assert node.last_access == newest(self.cache)
                i += len(node)

    def do_match(self, ns, tokens) -> MatchResult:
        expected = self.ref_match(ns, tokens)
        m = self.cache.match_prefix(tokens, namespace=ns)
        assert ids(m.slots) == expected
        assert (m.last_node is self.cache.root) == (not expected)
        node = m.last_node  # the matched path is now the most recently used
        while node is not self.cache.root:
            assert len(node) == 0 or node.last_access == newest(self.cache)
            node = node.parent
        return m

    # -- rules --

    @rule(q=QUERIES)
    def match(self, q):
        ns, tokens = self.query(q)
        self.do_match(ns, tokens)

    @rule(q=QUERIES)
    def insert_fresh(self, q):
        """Insert with all-new slots: the caller frees its duplicates and the unpaged tail."""
        ns, tokens = self.query(q)
        new = self.alloc(len(tokens))
        self.seen.append((ns, tokens))
        expected = self.ref_insert(ns, tokens, new)
        already = self.cache.insert(tokens, torch.tensor(new, dtype=torch.int64), namespace=ns)
        assert already == expected
        self.check_touched(ns, tokens)
        stored = 0 if self.cache.disable else len(tokens) // self.page * self.page
        self.give_back(new[:already] + new[stored:])

    @rule(q=QUERIES)
    def begin_request(self, q):
        """A request: match, lock, allocate the uncached rest."""
        ns, tokens = self.query(q)
        m = self.do_match(ns, tokens)
        self.cache.lock(m.last_node)
        cached = len(m.slots)
        row = ids(m.slots) + self.alloc(len(tokens) - cached)
        self.pending.append((ns, tokens, row, cached, m.last_node))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def finish_request(self, i):
        ns, tokens, row, cached, last_node = self.pending.pop(i % len(self.pending))
        self.seen.append((ns, tokens))
        expected = self.ref_insert(ns, tokens, row)
        already = self.cache.insert(tokens, torch.tensor(row, dtype=torch.int64), namespace=ns)
        assert already == expected and already >= cached
        self.check_touched(ns, tokens)
        self.cache.unlock(last_node)
        stored = 0 if self.cache.disable else len(tokens) // self.page * self.page
        self.give_back(row[cached:already] + row[max(stored, cached) :])

    @rule(q=QUERIES)
    def lock(self, q):
        ns, tokens = self.query(q)
        m = self.do_match(ns, tokens)
        self.cache.lock(m.last_node)
        self.locks.append((ns, tokens[: len(m.slots)], m.last_node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        _, _, node = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        evictable = self.cache.evictable_size()
        node_of = {s: node for node in nodes(self.cache) for s in ids(node.slots)}
        leaves = [x for x in nodes(self.cache) if len(x) and not x.children and not x.lock_ref]
        freed = ids(self.cache.evict(n))
        assert len(freed) >= min(n, evictable)
        if freed:  # least recently used leaf first; whole nodes, stopping once n are freed
            assert node_of[freed[0]].last_access == min(x.last_access for x in leaves)
            assert len(freed) - len(node_of[freed[-1]]) < n
        if len(freed) < n:
            assert self.cache.evictable_size() == 0
        protected = self.protected_keys()
        gone = set(freed)
        assert gone <= self.in_tree, "evict returned a slot the tree did not hold"
        for k in [k for k, page in self.ref.items() if gone.intersection(page)]:
            assert gone.issuperset(self.ref[k]), "evict freed part of a page"
            assert k not in protected, f"evicted locked prefix {k}"
            del self.ref[k]
        self.in_tree -= gone
        self.give_back(freed)
        for ns, prefix in self.ref:  # what is left stays prefix-closed
            if len(prefix) > self.page:
                assert (ns, prefix[: -self.page]) in self.ref

    # -- invariants --

    @invariant()
    def sizes_and_slots_agree(self):
        check_structure(self.cache)
        held = [s for node in nodes(self.cache) for s in ids(node.slots)]
        assert len(held) == len(set(held)), "a slot is in the tree twice"
        assert set(held) == self.in_tree
        assert self.cache.total_size() == len(held)
        protected_tokens = sum(len(self.ref[k]) for k in self.protected_keys() if k in self.ref)
        assert self.cache.protected_size() == protected_tokens
        # no leak: every slot ever allocated is free, in the tree, or held by a pending request
        pending = {s for _, _, row, cached, _ in self.pending for s in row[cached:]}
        assert not pending & self.free and not pending & self.in_tree
        assert not self.free & self.in_tree
        assert len(self.free) + len(self.in_tree) + len(pending) == self.next_slot


CacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheMachine = CacheMachine.TestCase


def test_the_ledger_invariant_names_a_difference():
    cache = RadixCache()
    cache.insert([1, 2, 3], torch.tensor([10, 11, 12]))
    cache.invariant()
    cache.ledger.evictable += 1  # a bookkeeping bug
    with pytest.raises(RuntimeError, match="evictable is 4, the tree holds 3"):
        cache.invariant()
    cache.ledger.evictable -= 1
    cache.ledger.leaves.clear()  # a leaf the LRU would never see
    with pytest.raises(RuntimeError, match="leaves is 0 nodes, the tree holds 1 nodes"):
        cache.invariant()
