"""N-gram drafts, no extra model: what followed the request's current suffix earlier in its own prompt and output
(extraction answers copy spans of their documents), or what an earlier request with the same whole context
went on with (the radix tree holds it).

The suffix index of a request is built once over its prompt and extended with each new token: for each length
n in [MIN_N, MAX_N], the latest position at which each n-token window was followed by another token. A lookup
tries the longest suffix first.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_N, MAX_N = 2, 4  # suffix lengths looked up: a single token repeats too often to predict what follows


class NgramIndex:
    """One request's tokens (prompt + output so far) and, per window length, each window's latest successor."""

    __slots__ = ("tokens", "tables", "indexed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_N, MAX_N + 1)}
        self.indexed = 0  # windows ending at positions [0, indexed) are in the tables

    def extend(self, new_tokens: Sequence[int]) -> None:
        t = self.tokens
        t.extend(new_tokens)
        # index the windows that end at [indexed, len - 1): each has a successor; the final one (the suffix a
        # lookup asks for) is indexed once the next token arrives, so that it never finds itself
        for end in range(self.indexed, len(t) - 1):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table[tuple(t[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(t) - 1)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest suffix found."""
        t = self.tokens
        for n in range(min(MAX_N, len(t)), MIN_N - 1, -1):
            at = self.tables[n].get(tuple(t[len(t) - n:]))
            if at is not None:
                return t[at:at + max_tokens]
        return []


class NgramDrafter:
    """Drafts from the radix tree's continuation of the request's whole context when it has one (an earlier
    request with this very context), else from the request's own suffix index."""

    needs_slots = False  # proposes from tokens alone; the verification computes every draft's K/V
    forward_cost = 0.0  # no model runs to draft

    def __init__(self, kv) -> None:
        self.kv = kv  # the KV cache manager, for its read-only continuation lookups

    def propose(self, req, max_tokens: int) -> list[int]:
        spec = req.spec
        if spec.index is None:
            spec.index = NgramIndex()
        index, seen, n_in = spec.index, len(spec.index.tokens), len(req.input_ids)
        index.extend(req.input_ids[seen:] + req.output_ids if seen < n_in else req.output_ids[seen - n_in:])
        if max_tokens <= 0:
            return []
        return self.kv.continuation(index.tokens, req.namespace, max_tokens) or index.propose(max_tokens)
