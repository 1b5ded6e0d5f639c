"""Routing decisions of each policy, with fake loads and a fake clock; the approximate prefix tree."""

from __future__ import annotations

import random

import pytest

from radixgen.router.policies import CacheAware, Candidate, Random, RoundRobin, ShortestQueue, make_policy
from radixgen.router.prefix_tree import PrefixTree, common_len


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, dt: float = 1.0) -> None:
        self.now += dt


def cands(**loads: int) -> list[Candidate]:
    return [Candidate(url, load) for url, load in loads.items()]


# ------------------------------------------------------------ the tree


def test_common_len():
    assert common_len("abcdef", "abcxyz") == 3
    assert common_len("abc", "zzabcd", 2) == 3
    assert common_len("abcd", "ab") == 2
    assert common_len("", "abc") == 0
    text = "x" * 5000 + "y"
    assert common_len(text, "x" * 5000 + "z") == 5000


def test_tree_match_insert_split():
    t = PrefixTree(1000)
    assert t.match_len("hello world") == 0
    t.insert("hello world")
    assert t.size == 11
    assert t.match_len("hello world") == 11
    assert t.match_len("hello there") == 6
    assert t.match_len("help") == 3
    t.insert("hello there")  # splits "hello world" at 6: only "there" is new
    assert t.size == 11 + 5
    assert t.match_len("hello there, again") == 11
    assert t.match_len("hello world") == 11
    t.insert("hello")  # a prefix of what is there adds nothing
    assert t.size == 16


def test_tree_lru_eviction_keeps_recent_prefixes():
    clock = FakeClock()
    t = PrefixTree(100, clock)
    t.insert("A" * 40)
    clock.tick()
    t.insert("B" * 40)
    clock.tick()
    t.insert("A" * 40 + "a")  # A is used again: B is now the least recently used
    clock.tick()
    t.insert("C" * 40)  # 121 > 100: evict down to 90, oldest leaves first
    assert t.size <= 100
    assert t.match_len("B" * 40) == 0
    assert t.match_len("A" * 40 + "a") == 41
    assert t.match_len("C" * 40) == 40


def test_tree_evicts_inner_nodes_once_their_children_are_gone():
    clock = FakeClock()
    t = PrefixTree(10_000, clock)
    t.insert("shared-" + "x" * 10)
    t.insert("shared-" + "y" * 10)
    assert t.num_nodes() == 4  # root, "shared-", the two tails
    assert t.evict(0) == 27
    assert t.size == 0 and t.num_nodes() == 1
    assert t.match_len("shared-") == 0


def test_tree_stays_bounded_under_many_inserts():
    t = PrefixTree(5000)
    rng = random.Random(0)
    for i in range(500):
        t.insert(f"prefix {i % 7} " * 10 + "".join(rng.choice("abc") for _ in range(30)))
        assert t.size <= 5000
    assert t.size == sum(len(n.label) for n in t._nodes())


# ------------------------------------------------------------ policies


def test_round_robin_cycles():
    p = RoundRobin()
    c = cands(a=0, b=5, c=0)
    assert [p.choose("x", c).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_random_uses_its_rng():
    p = Random(random.Random(1))
    picks = {p.choose("x", cands(a=0, b=0, c=0)).url for _ in range(60)}
    assert picks == {"a", "b", "c"}


def test_shortest_queue_picks_least_loaded_and_rotates_ties():
    p = ShortestQueue()
    assert p.choose("x", cands(a=3, b=1, c=2)).url == "b"
    tied = [p.choose("x", cands(a=1, b=1, c=4)).url for _ in range(4)]
    assert set(tied) == {"a", "b"}


def test_cache_aware_sticks_to_the_worker_holding_the_prefix():
    p = CacheAware(balance_abs=4, balance_rel=1.5, clock=FakeClock())
    system_a, system_b = "You are agent A. " * 20, "You are agent B. " * 20
    first_a = p.choose(system_a + "q1", cands(w0=0, w1=0))
    first_b = p.choose(system_b + "q1", cands(w0=0, w1=0))
    assert first_a.matched == 0
    # "You are agent " is shared but far below half the prompt: a new prefix, to the worker holding less text
    assert first_b.url != first_a.url and first_b.matched == 0
    for i in range(5):
        d = p.choose(system_a + f"question {i}", cands(w0=1, w1=2))
        assert d.url == first_a.url
        assert d.matched >= len(system_a)
        d = p.choose(system_b + f"question {i}", cands(w0=2, w1=1))
        assert d.url == first_b.url


def test_cache_aware_short_matches_count_as_none():
    p = CacheAware(balance_abs=100, cache_threshold=0.5)
    p.choose("0123456789" + "a" * 10, cands(w0=0, w1=5))  # to w0, the least loaded
    assert p.choose("0123456789" + "b" * 10, cands(w0=3, w1=1)).url == "w0"  # 10 of 20 matched: not below half
    assert p.choose("0123456789" + "c" * 11, cands(w0=3, w1=1)).url == "w1"  # 10 of 21: below half
    strict = CacheAware(balance_abs=100, cache_threshold=0.0)
    strict.choose("0123456789" + "a" * 90, cands(w0=0, w1=5))
    assert strict.choose("0" + "x" * 99, cands(w0=3, w1=1)).url == "w0"  # any match wins at threshold 0


def test_cache_aware_prefers_least_loaded_among_equal_matches():
    p = CacheAware(balance_abs=100)
    assert p.choose("new prompt", cands(w0=5, w1=2, w2=3)).url == "w1"


def test_cache_aware_balances_when_loads_diverge():
    p = CacheAware(balance_abs=4, balance_rel=1.5)
    prompt = "a long shared prefix " * 10
    owner = p.choose(prompt, cands(w0=0, w1=0)).url
    other = "w1" if owner == "w0" else "w0"
    # max - min = 4 is not > 4: the match wins
    assert p.choose(prompt + "1", cands(**{owner: 6, other: 2})).url == owner
    # both conditions are needed: 105 - 100 > 4 but 105 < 1.5 * 100
    assert p.choose(prompt + "3", cands(**{owner: 105, other: 100})).url == owner
    # max - min = 5 > 4 and 7 > 1.5 * 2: the least loaded wins, whatever it holds
    d = p.choose(prompt + "2", cands(**{owner: 7, other: 2}))
    assert d.url == other and d.matched == 0


def test_cache_aware_forgets_a_dead_worker():
    p = CacheAware()
    prompt = "remember me " * 10
    owner = p.choose(prompt, cands(w0=0, w1=0)).url
    assert p.choose(prompt, cands(w0=0, w1=0)).matched == len(prompt)
    p.forget(owner)
    assert owner not in p.trees
    d = p.choose(prompt, cands(**{owner: 0}))  # it came back: an empty tree
    assert d.matched == 0


def test_cache_aware_lru_bound_per_worker():
    clock = FakeClock()
    p = CacheAware(max_tree_chars=1000, clock=clock)
    for i in range(50):
        clock.tick()
        p.choose(f"{i:03d}" + "z" * 100, cands(w0=0))
    assert p.trees["w0"].size <= 1000
    assert p.trees["w0"].match_len("049" + "z" * 100) == 103  # the newest is kept
    assert p.trees["w0"].match_len("000" + "z" * 100) < 3  # the oldest is gone ("0" is shared with "049")


def test_make_policy():
    assert isinstance(make_policy("cache_aware", balance_abs=3), CacheAware)
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="balance"):
        CacheAware(balance_rel=0.5)


# ------------------------------------------------------------ image requests


def test_cache_aware_tells_image_requests_with_the_same_text_apart():
    """Two requests with the same text and different images are no cache hit of each other (the router's key holds
    a digest of each image, as a worker's radix key holds the image's hash); the same image again is one, and a
    chat message keys its image_url part in its place."""
    from radixgen.router.proxy import prompt_text

    text = "USER: <image>\nWhat is in this picture? Describe every detail you can see."
    cat, dog = "data:image/png;base64,Y2F0IGltYWdl", "data:image/png;base64,ZG9nIGltYWdl"
    p = CacheAware(cache_threshold=0.5)
    first = p.choose(prompt_text({"text": text, "image_data": cat}), cands(w1=0, w2=0))
    other = p.choose(prompt_text({"text": text, "image_data": dog}), cands(w1=0, w2=0))
    assert other.matched < 2 and other.url != first.url  # no hit: it goes to the emptier worker
    again = p.choose(prompt_text({"text": text, "image_data": [cat]}), cands(w1=0, w2=0))
    assert again.url == first.url and again.matched == len(prompt_text({"text": text, "image_data": cat}))
    text_only = p.choose(prompt_text({"text": text}), cands(w1=0, w2=0))
    assert text_only.matched == 0  # the text alone is not what either worker holds
    # a batch: one entry per prompt
    batch = prompt_text({"text": [text, text], "image_data": [cat, None]})
    assert batch.startswith(prompt_text({"text": text, "image_data": cat}) + "\n" + text)

    def chat(url: str) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": "You describe pictures."}, {
            "role": "user", "content": [{"type": "text", "text": "Look: "},
                                        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                        {"type": "text", "text": " What is it?"}]}]}

    a, b = prompt_text(chat(cat)), prompt_text(chat(dog))
    assert a != b and a.endswith(" What is it?\n")
    q = CacheAware(cache_threshold=0.9)
    first = q.choose(a, cands(w1=0, w2=0))
    other = q.choose(b, cands(w1=0, w2=0))
    shared = a.index("\x01") + 1  # the system turn and "Look: " are shared; the image is not
    assert other.url != first.url and shared <= q.tree(first.url).match_len(b) < shared + 3
    assert q.choose(a, cands(w1=0, w2=0)) == (first.url, len(a))
