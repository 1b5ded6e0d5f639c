"""The in-step prefix policy (scheduler/policy.AdmissionPolicy.shares_uncached_prefix) over prompts with images:
it compares the tree's keys, in which an image's placeholder ids are replaced by ids of its content hash, so
requests about one image wait for the first one's prefill and requests about different images never wait."""

from __future__ import annotations

from radixgen.common.prompt import MediaItem
from radixgen.common.sampling_params import SamplingParams
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.ground.kv_pool import new_req_to_slot_table
from radixgen.runtime.scheduler.kv_manager import KVCacheManager
from radixgen.runtime.scheduler.policy import SHARED_PREFIX_DEFER_TOKENS, AdmissionPolicy
from radixgen.runtime.scheduler.request import GenerateRequest, Req

PAD = 900  # the placeholder id of every image
IMAGE_TOKENS = 2 * SHARED_PREFIX_DEFER_TOKENS


def image_req(rid: str, image_hash: str, question: list[int]) -> Req:
    ids = [1, 2, 3] + [PAD] * IMAGE_TOKENS + question
    item = MediaItem("image", image_hash, 3, 3 + IMAGE_TOKENS)
    return Req(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=4), media=(item,)), 0)


def policy(disable_cache: bool = False) -> AdmissionPolicy:
    kv = KVCacheManager(257, new_req_to_slot_table(4, 128), disable_cache=disable_cache)
    return AdmissionPolicy(RuntimeConfig(disable_radix_cache=disable_cache), kv)


def test_same_image_waits_for_the_first_and_another_image_does_not():
    pol = policy()
    first = image_req("a", "hash-one", [10, 11])
    same = image_req("b", "hash-one", [20, 21])
    other = image_req("c", "hash-two", [10, 11])  # the same ids as `first`: only the image differs
    assert same.input_ids[:-2] == other.input_ids[:-2]
    assert pol.shares_uncached_prefix(same, [first])
    assert not pol.shares_uncached_prefix(other, [first])
    # once the first one's prompt is in the tree, the same image's request has nothing left to wait for
    kv = pol.kv
    assert kv.admit(first)
    kv.extend(first, first.remaining_prefill)
    kv.cache_computed(first)
    assert kv.cached_prefix_len(same) == 3 + IMAGE_TOKENS
    assert not pol.shares_uncached_prefix(same, [first])
    assert kv.cached_prefix_len(other) == 3  # the text before the image only


def test_no_wait_without_the_radix_cache():
    pol = policy(disable_cache=True)
    assert not pol.shares_uncached_prefix(image_req("b", "h", [2]), [image_req("a", "h", [1])])
