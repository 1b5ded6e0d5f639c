"""Routing policies: each picks one worker for a request from the healthy candidates and their loads.

A policy sees only the prompt text and (url, load) pairs, so a test drives it with fake loads and a
fake clock; the router owns the workers, their health and their in-flight counts."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import ClassVar, NamedTuple

from radixgen.router.prefix_tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "random", "shortest_queue")


class Candidate(NamedTuple):
    url: str
    load: int  # requests the router has in flight on this worker


class Decision(NamedTuple):
    url: str
    matched: int  # prompt characters the chosen worker's tree already held (cache_aware; else 0)


class Policy:
    name: ClassVar[str]

    def choose(self, text: str, candidates: list[Candidate]) -> Decision:
        """`candidates` is never empty (the router answers 503 itself when no worker is healthy)."""
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """The worker left the rotation (dead or removed): drop what is known of it."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, text: str, candidates: list[Candidate]) -> Decision:
        c = candidates[self.turn % len(candidates)]
        self.turn += 1
        return Decision(c.url, 0)


class Random(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, text: str, candidates: list[Candidate]) -> Decision:
        return Decision(self.rng.choice(candidates).url, 0)


class ShortestQueue(Policy):
    """The worker with the fewest requests in flight; ties go round in turn (not always the first)."""

    name = "shortest_queue"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, text: str, candidates: list[Candidate]) -> Decision:
        least = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == least]
        c = tied[self.turn % len(tied)]
        self.turn += 1
        return Decision(c.url, 0)


class CacheAware(Policy):
    """The worker whose tree holds the longest prefix of the prompt; among equal matches the least loaded,
    then the one holding the least text. A match shorter than `cache_threshold` of the prompt counts as
    none (prompts that share only "You are a" are new prefixes: they spread over the workers by load and
    tree size rather than pile onto the first worker). When the loads are out of balance
    (max - min > balance_abs and max > balance_rel * min) the least loaded worker takes the request
    whatever it holds. The prompt goes into the chosen worker's tree either way."""

    name = "cache_aware"

    def __init__(
        self,
        balance_abs: int = 32,
        balance_rel: float = 1.5,
        cache_threshold: float = 0.5,
        max_tree_chars: int = 1 << 24,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1 (got {balance_abs}, {balance_rel})")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_chars = max_tree_chars
        self.clock = clock
        self.trees: dict[str, PrefixTree] = {}

    def tree(self, url: str) -> PrefixTree:
        if url not in self.trees:
            self.trees[url] = PrefixTree(self.max_tree_chars, self.clock)
        return self.trees[url]

    def imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, text: str, candidates: list[Candidate]) -> Decision:
        matches = {c.url: self.tree(c.url).match_len(text) for c in candidates}
        longest = max(matches.values())
        if self.imbalanced(candidates) or longest == 0 or longest < self.cache_threshold * len(text):
            best = min(candidates, key=lambda c: (c.load, self.tree(c.url).size))
        else:
            best = min(candidates, key=lambda c: (-matches[c.url], c.load, self.tree(c.url).size))
        self.tree(best.url).insert(text)
        return Decision(best.url, matches[best.url])

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)


def make_policy(name: str, **cache_aware_opts) -> Policy:
    if name == "cache_aware":
        return CacheAware(**cache_aware_opts)
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})")
    return {"round_robin": RoundRobin, "random": Random, "shortest_queue": ShortestQueue}[name]()
