"""Encoder outputs kept for reuse: an image's embeddings by its content hash, LRU, bounded in image tokens.

One image asked N questions is encoded once: the questions' prompts differ after the image, so the radix tree
holds the image's KV only up to where they part (or not at all when the image comes after differing text), and
every request that computes any row of the image needs its embeddings. Entries belong to no request (a request
never pins one), so a retracted or aborted request leaves nothing behind; an entry evicted between two chunks of
one prompt is encoded again, at a cost in time only. `take` gives a step's embeddings, encoding the missing ones
in one call (batched over the step's requests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = self.encoded_items = self.encode_calls = 0

    def take(self, items: dict[str, object], encode: Callable[[list], list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The embeddings of `items` (content hash -> ProcessedImage): cached ones, and the others encoded in one
        `encode` call, then kept (the least recently used entries evicted beyond the capacity)."""
        out, missing = {}, []
        for h, item in items.items():
            emb = self._entries.get(h)
            if emb is None:
                missing.append((h, item))
                continue
            self._entries.move_to_end(h)
            out[h] = emb
            self.hits += 1
        if missing:
            self.misses += len(missing)
            embs = encode([it for _, it in missing])
            self.encode_calls += 1
            self.encoded_items += len(missing)
            for (h, _), emb in zip(missing, embs, strict=True):
                out[h] = emb
                self._put(h, emb)
        return out

    def _put(self, h: str, emb: torch.Tensor) -> None:
        n = emb.shape[0]
        if n > self.capacity:
            return  # never kept: it would evict everything and still not fit
        self._entries[h] = emb
        self.tokens += n
        while self.tokens > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.shape[0]

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def info(self) -> dict:
        return {"entries": len(self._entries), "tokens": self.tokens, "capacity_tokens": self.capacity,
                "hits": self.hits, "misses": self.misses, "encoded_items": self.encoded_items,
                "encode_calls": self.encode_calls}
