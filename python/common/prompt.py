"""A prompt as a sequence of segments, and the radix-tree key of a tokenized one.

`Prompt` holds text, token ids and media items in order. The Engine turns it into token ids plus one
`MediaItem` per media segment (its kind, content hash, the span of placeholder ids it occupies, an opaque
payload reference), carried to the scheduler by the one request message; so image input later needs no new
field anywhere between the API and the scheduler's `Req`.

The radix key (`radix_key`): the ids with every media span's ids replaced by ids derived from the item's
content hash. Those ids are negative, so no token id (always >= 0) can collide with them; the same image gives
the same key (its KV is shared), two images differ from the first position of their spans on (their KV never
is). A text-only prompt's key is its ids themselves (the same list, not a copy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MEDIA_KINDS = ("image", "video", "audio")
_KEY_SPACE = 2**62  # key ids are in [-2**62, -1]


@dataclass(frozen=True)
class TextSegment:
    text: str


@dataclass(frozen=True)
class TokenSegment:
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(self.ids))


@dataclass(frozen=True)
class MediaSegment:
    """One media input. `payload`: the source the model's processor reads (for an image: a path, bytes, base64, a
    data URL, a PIL image; common/media.py). `content_hash` identifies its content (two equal hashes share KV):
    leave it empty and the Engine sets the item's hash from the processed pixels and the processing options
    (runtime/media/processor.py), the usual case; a caller that gives one vouches that equal hashes mean equal
    content after processing."""

    kind: str
    payload: Any = None
    content_hash: str = ""

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_KINDS:
            raise ValueError(f"MediaSegment.kind: must be one of {MEDIA_KINDS} (got {self.kind!r})")
        if not isinstance(self.content_hash, str):
            raise ValueError("MediaSegment.content_hash: must be a string (empty: hashed from the processed pixels)")
        if self.payload is None:
            raise ValueError("MediaSegment.payload: the media source is missing")

    @classmethod
    def image(cls, source: Any) -> MediaSegment:
        """An image segment from any source common.media.load_image reads."""
        return cls("image", source)

    @classmethod
    def of_bytes(cls, kind: str, data: bytes, payload: Any = None) -> MediaSegment:
        """A segment whose hash is that of its bytes (sha256), its payload the bytes unless given."""
        return cls(kind, data if payload is None else payload, hashlib.sha256(data).hexdigest())


Segment = TextSegment | TokenSegment | MediaSegment


@dataclass(frozen=True)
class Prompt:
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        segments = tuple(self.segments)
        for s in segments:
            if not isinstance(s, (TextSegment, TokenSegment, MediaSegment)):
                raise ValueError(f"Prompt: a segment is a TextSegment, TokenSegment or MediaSegment, got {s!r}")
        object.__setattr__(self, "segments", segments)

    @classmethod
    def of(cls, *parts: str | Sequence[int] | Segment) -> Prompt:
        """From parts in order: a str is text, a list of ints token ids, a segment itself."""
        segments: list[Segment] = []
        for p in parts:
            if isinstance(p, str):
                segments.append(TextSegment(p))
            elif isinstance(p, (TextSegment, TokenSegment, MediaSegment)):
                segments.append(p)
            else:
                segments.append(TokenSegment(tuple(p)))
        return cls(tuple(segments))

    @property
    def media(self) -> tuple[MediaSegment, ...]:
        return tuple(s for s in self.segments if isinstance(s, MediaSegment))


@dataclass(frozen=True)
class MediaItem:
    """A media segment once the prompt is tokenized: its placeholder ids are ids[start:end]."""

    kind: str
    content_hash: str
    start: int
    end: int
    payload: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"MediaItem: the span [{self.start}, {self.end}) must be non-empty and start at >= 0")


def media_key_ids(content_hash: str, length: int) -> list[int]:
    """`length` key ids of one media item, all negative: position j of the span is -1 - ((h + j) mod 2**62)
    with h from the content hash (blake2b, so any hash string spreads over the key space)."""
    h = int.from_bytes(hashlib.blake2b(content_hash.encode(), digest_size=8).digest(), "big")
    return [-1 - ((h + j) % _KEY_SPACE) for j in range(length)]


def radix_key(ids: list[int], media: Sequence[MediaItem]) -> list[int]:
    """The radix-tree key of tokenized prompt `ids` with `media` spans (see the module docstring)."""
    if not media:
        return ids  # text only: the ids themselves, at no cost
    key = list(ids)
    for item in media:
        if item.end > len(ids):
            raise ValueError(f"MediaItem: the span [{item.start}, {item.end}) is past the prompt ({len(ids)} ids)")
        key[item.start:item.end] = media_key_ids(item.content_hash, item.end - item.start)
    return key
