"""The KV cache manager on its own: paired verbs, request-level admit / extend / cache / release, free_tail
(speculative rollback), namespaces, eviction, and the idle invariant after every sequence."""

from __future__ import annotations

import pytest
import torch

from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.ground.kv_pool import new_req_to_slot_table
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.request import GenerateRequest, Req


def manager(slots: int = 64, rows: int = 4, page_size: int = 1) -> KVCacheManager:
    return KVCacheManager(slots + 1, new_req_to_slot_table(rows, 128), page_size=page_size)


def req(rid: str, ids: list[int], namespace: str | None = None) -> Req:
    return Req(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=8), cache_salt=namespace), 0)


def compute(kv: KVCacheManager, r: Req) -> None:
    """What a step does to the KV bookkeeping: slots for the rest of the sequence, then cache them."""
    kv.extend(r, r.remaining_prefill)
    kv.cache_computed(r)


def test_admit_extend_cache_release_and_the_shared_prefix():
    kv = manager()
    a = req("a", list(range(10, 30)))
    assert kv.admit(a) and a.cached_len == 0
    compute(kv, a)
    assert a.cached_len == 20 and kv.usage()["protected"] == 20
    # the table the runner reads holds a's slots
    row = kv.table.table[a.table_row, :20]
    assert row.unique().numel() == 20 and (row > 0).all()
    b = req("b", list(range(10, 25)) + [99, 98])
    assert kv.admit(b)
    assert b.cached_len == 15  # shares a's first 15 tokens
    assert torch.equal(kv.table.table[b.table_row, :15], row[:15])
    compute(kv, b)
    for r in (a, b):
        kv.release(r)
        kv.release(r)  # idempotent
    assert kv.invariant_holds()
    assert kv.usage()["evictable"] == 22 and kv.usage()["free"] == 64 - 22


def test_free_tail_gives_back_only_owned_slots():
    kv = manager()
    a = req("a", list(range(10, 30)))
    kv.admit(a)
    compute(kv, a)  # [0, 20) in the tree
    a.output_ids += [1, 2, 3, 4]
    kv.extend(a, 4)  # four draft positions
    free_before = kv.allocator.available()
    kv.free_tail(a, 3)  # three of them rejected
    assert a.kv_len == 21 and kv.allocator.available() == free_before + 3
    with pytest.raises(ValueError, match="owns 1 slots"):
        kv.free_tail(a, 2)  # cannot reach into the cached prefix
    a.output_ids[1:] = []
    kv.release(a)
    assert kv.invariant_holds()
    assert kv.usage()["evictable"] == 21  # the prompt and the accepted token


def test_unadmit_and_rows():
    kv = manager(rows=2)
    a, b, c = (req(x, [1, 2, 3]) for x in "abc")
    assert kv.admit(a) and kv.admit(b)
    assert not kv.admit(c)  # no free row
    kv.unadmit(b)
    assert kv.admit(c)
    kv.extend(c, 3)
    with pytest.raises(RuntimeError, match="owns 3 slots"):
        kv.unadmit(c)
    kv.release(c)
    kv.unadmit(a)
    assert kv.invariant_holds()


def test_namespaces_do_not_share_and_eviction_frees_lru():
    kv = manager(slots=40)
    a = req("a", list(range(100, 130)), namespace="alice")
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    b = req("b", list(range(100, 130)), namespace="bob")
    kv.admit(b)
    assert b.cached_len == 0  # alice's prefix is not bob's
    assert kv.can_allocate(30) and kv.allocator.available() == 10
    kv.extend(b, 30)  # evicts alice's cached tokens to make room
    assert kv.evicted_tokens >= 20
    kv.cache_computed(b)
    kv.release(b)
    assert kv.invariant_holds()
    kv.flush()
    assert kv.usage()["free"] == 40 and kv.invariant_holds()


def test_invariant_reports_a_leak():
    kv = manager()
    a = req("a", [5, 6, 7])
    kv.admit(a)
    kv.extend(a, 3)
    assert not kv.invariant_holds()  # a holds a row and 3 slots
    kv.release(a)
    assert kv.invariant_holds()


# ---------------------------------------------------------------- media items: the radix key


def media_req(rid: str, ids: list[int], *items) -> Req:
    """A request whose ids[start:end] are the placeholder ids of a media item with the given content hash."""
    from radixgen.common.prompt import MediaItem

    media = tuple(MediaItem("image", h, start, end) for h, start, end in items)
    return Req(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=8), media=media), 0)


PLACEHOLDER = 7  # the same placeholder id at every image position, as vision models tokenize an image


def test_a_text_request_keys_the_tree_with_its_ids_at_no_cost():
    r = req("a", list(range(10, 20)))
    assert r.prompt_key is r.input_ids
    r.output_ids += [3, 4]
    assert r.radix_key == r.fill_ids


def test_the_same_image_shares_kv_and_a_different_one_never_does():
    kv = manager()
    ids = [1, 2, 3] + [PLACEHOLDER] * 6 + [4, 5, 6]
    a = media_req("a", ids, ("cat", 3, 9))
    assert all(t < 0 for t in a.radix_key[3:9]) and a.radix_key[:3] == [1, 2, 3] and a.radix_key[9:] == [4, 5, 6]
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    same = media_req("same", ids + [8], ("cat", 3, 9))
    assert same.radix_key[:12] == a.radix_key
    kv.admit(same)
    assert same.cached_len == len(ids)  # the whole prompt, image included, from the tree
    kv.release(same)
    other = media_req("other", ids + [8], ("dog", 3, 9))
    kv.admit(other)
    assert other.cached_len == 3  # the text before the image only: different images never share KV
    kv.release(other)
    text = req("text", ids + [8])  # the placeholder ids as plain text: no key id is a token id
    kv.admit(text)
    assert text.cached_len == 3
    kv.release(text)
    assert kv.invariant_holds()


def test_media_key_ids_are_outside_any_vocabulary_and_depend_on_position_and_hash():
    from radixgen.common.prompt import media_key_ids, radix_key

    a, b = media_key_ids("cat", 64), media_key_ids("dog", 64)
    assert all(t < 0 for t in a + b) and len(set(a)) == 64
    assert a == media_key_ids("cat", 64) and a[0] != b[0]
    r = media_req("two", [PLACEHOLDER] * 4 + [9] + [PLACEHOLDER] * 4, ("cat", 0, 4), ("cat", 5, 9))
    assert r.radix_key[:4] == r.radix_key[5:] == a[:4]  # one image twice: the same key ids each time
    with pytest.raises(ValueError, match="past the prompt"):
        from radixgen.common.prompt import MediaItem

        radix_key([1, 2], [MediaItem("image", "cat", 1, 3)])


def test_drafts_from_the_tree_stop_before_a_media_span():
    kv = manager()
    a = media_req("a", [1, 2, 3] + [PLACEHOLDER] * 4 + [5], ("cat", 3, 7))
    kv.admit(a)
    compute(kv, a)
    kv.release(a)
    assert kv.continuation([1, 2], max_tokens=6) == [3]  # never a key id as a draft token
