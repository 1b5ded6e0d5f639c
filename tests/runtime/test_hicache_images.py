"""Image requests with the hierarchical cache (tiny random Qwen2-VL through the real Engine, float32): an image
prompt's KV, keyed by the image's hash, is evicted from a small pool to the host tier and written to the disk tier;
asked again, it comes back from a lower tier with transformers' greedy output; another image behind the same
placeholder ids never reads it, in any tier; a new server over the same directory (a restart) finds each image's
pages on disk. The host tier keeps the pool's format here: the default compact int8 tier rounds the KV, which moves
a tiny random model's near-tie greedy tokens."""

from __future__ import annotations

import pytest
from tiny_vl_models import hf_greedy_ids, random_image, tiny_vl_dir

from radixgen.common.prompt import MediaSegment, Prompt
from radixgen.runtime.engine import Engine

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
BEFORE, AFTER = [5, 17, 33, 400, 12], [9, 2001, 77, 314, 1500, 6, 8]


@pytest.fixture(scope="module")
def ref():
    import transformers as tf

    from radixgen.runtime.loader import read_hf_config
    from radixgen.runtime.media import processor_for

    folder = tiny_vl_dir("qwen2_vl")
    proc = processor_for("qwen2_vl", read_hf_config(folder), folder)
    model = tf.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype="float32").eval()
    want = {}
    for seed in (0, 1):  # two images of one size: the same placeholder ids, other pixels
        px = proc.process(random_image(seed, 80, 120))
        ids = BEFORE + proc.tokens(px).ids + AFTER
        want[seed] = hf_greedy_ids(model, px, ids, NEW_TOKENS)
    return folder, want


def ask(eng, seed: int) -> dict:
    return eng.generate(Prompt.of(BEFORE, MediaSegment.image(random_image(seed, 80, 120)), AFTER), GREEDY)


def evict(eng) -> None:
    """Text prompts that fill the 96-token pool: what was cached moves down to the host tier."""
    for i in range(3):
        eng.generate(input_ids=[100 + i] * 60, sampling_params={"max_new_tokens": 1})


def test_image_prefix_through_the_host_and_disk_tiers_and_a_restart(ref, tmp_path):
    folder, want = ref
    opts = dict(dtype="float32", max_total_tokens=96, page_size=4, max_running_requests=2,
                enable_hierarchical_cache=True, hicache_kv_format="model", hicache_write_policy="write_through",
                kv_cache_dir=str(tmp_path))  # the host tier in the pool's format: exact (int8 would round the KV)
    with Engine(str(folder), **opts) as eng:
        first = ask(eng, 0)
        assert first["output_ids"] == want[0]
        prompt_len = first["meta_info"]["prompt_tokens"]
        evict(eng)
        again = ask(eng, 0)
        assert again["output_ids"] == want[0]
        tiers = again["meta_info"]["cached_tokens_details"]
        assert tiers["host"] + tiers["disk"] >= prompt_len - len(BEFORE) - 4, tiers  # the image came back
        evict(eng)
        other = ask(eng, 1)  # same placeholder ids, other pixels: at most the text before the image is shared
        assert other["output_ids"] == want[1]
        assert other["meta_info"]["cached_tokens"] <= len(BEFORE) + 1
        assert eng.get_server_info()["invariant_ok"]
    with Engine(str(folder), **opts) as eng:  # a restart: the disk tier has both images' pages, by their hashes
        warm = ask(eng, 0)
        assert warm["output_ids"] == want[0]
        assert warm["meta_info"]["cached_tokens_details"]["disk"] >= prompt_len - len(BEFORE) - 4
        other = ask(eng, 1)  # its own pages, written by the first server under its own hash
        assert other["output_ids"] == want[1]
        assert other["meta_info"]["cached_tokens_details"]["disk"] >= prompt_len - len(BEFORE) - 4
        assert eng.get_server_info()["invariant_ok"]
