"""Qwen2-VL / Qwen2.5-VL through the real Engine (scheduler process, paged KV pool, radix cache, chunked
prefill): greedy output equal to transformers' generate over 32 tokens (float32), with prompt chunks that cut
through the image; the same image asked again reuses its KV and its encoder output, a different image neither."""

from __future__ import annotations

import pytest
import torch
from tiny_vl_models import IMAGE_TOKEN, hf_greedy_ids, random_image, tiny_vl_dir

from radixgen.common.prompt import MediaSegment, Prompt
from radixgen.runtime.engine import Engine

NEW_TOKENS = 32
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
BEFORE, AFTER = [5, 17, 33, 400, 12], [9, 2001, 77, 314, 1500, 6, 8]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request):
    folder = tiny_vl_dir(request.param)
    # chunks of 16 tokens: the 20 image tokens at prompt positions [6, 26) are cut at 16
    with Engine(str(folder), dtype="float32", max_total_tokens=4096, chunked_prefill_size=16) as eng:
        yield request.param, folder, eng


def hf_greedy(arch, folder, image, before, after) -> tuple[list[int], list[int]]:
    import transformers as tf

    from radixgen.runtime.loader import read_hf_config
    from radixgen.runtime.media import processor_for

    proc = processor_for(arch, read_hf_config(folder), folder)
    px = proc.process(image)
    ids = before + proc.tokens(px).ids + after
    cls = {"qwen2_vl": tf.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration}[arch]
    ref = cls.from_pretrained(folder, dtype=torch.float32).eval()
    return ids, hf_greedy_ids(ref, px, ids, NEW_TOKENS)


def test_greedy_equals_transformers_through_chunks_and_cache(vl):
    arch, folder, eng = vl
    image = random_image(0, 100, 150)
    ids, want = hf_greedy(arch, folder, image, BEFORE, AFTER)
    first = eng.generate(Prompt.of(BEFORE, MediaSegment.image(image), AFTER), GREEDY)
    assert first["output_ids"] == want
    assert first["meta_info"]["prompt_tokens"] == len(ids)
    # the same prompt again: its whole prompt (the image included) from the radix tree, the same output
    again = eng.generate(Prompt.of(BEFORE, MediaSegment.image(image), AFTER), GREEDY)
    assert again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
    assert eng.get_server_info()["invariant_ok"]


def test_repeated_image_hits_the_caches_a_different_one_does_not(vl):
    _, _, eng = vl
    image, other = random_image(3, 80, 120), random_image(4, 80, 120)
    before = eng.get_server_info()["encoder_cache"]
    params = {"max_new_tokens": 4, "temperature": 0.0}
    a = eng.generate(Prompt.of(BEFORE, MediaSegment.image(image), [11, 12]), params)
    b = eng.generate(Prompt.of(BEFORE, MediaSegment.image(image), [13, 14, 15]), params)  # another question
    c = eng.generate(Prompt.of(BEFORE, MediaSegment.image(other), [11, 12]), params)  # same size, other pixels
    pads = a["meta_info"]["prompt_tokens"] - len(BEFORE) - 2 - 2  # between vision_start and vision_end
    assert pads == 12  # 80 x 120 pixels -> 84 x 112: 6 x 8 patches, 3 x 4 merged
    assert a["meta_info"]["cached_tokens"] <= len(BEFORE) + 1  # the text before the image (from the other test)
    assert b["meta_info"]["cached_tokens"] >= len(BEFORE) + 1 + pads + 1  # the image's KV reused
    assert c["meta_info"]["cached_tokens"] <= len(BEFORE) + 1  # at most the text and vision_start before it
    after = eng.get_server_info()["encoder_cache"]
    assert after["encoded_items"] - before["encoded_items"] == 2  # `image` once, `other` once
    assert eng.get_server_info()["invariant_ok"]


def test_mixed_batch_equals_each_request_alone(vl):
    """Image requests of different M-RoPE deltas and a text-only one decoded in one batch: each as alone."""
    _, _, eng = vl
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    prompts = [Prompt.of([7, 8, 9], MediaSegment.image(random_image(6, 60, 90)), [21, 22]),
               Prompt.of([7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
               Prompt.of([30, 31], MediaSegment.image(random_image(7, 150, 60)), [40, 41, 42, 43])]
    alone = []
    for p in prompts:
        eng.flush_cache()
        alone.append(eng.generate(p, params)["output_ids"])
    eng.flush_cache()
    together = [r["output_ids"] for r in eng.generate(prompts, params)]
    assert together == alone
    assert eng.get_server_info()["invariant_ok"]


def test_bad_image_inputs_are_refused(vl):
    from radixgen.runtime.engine.request_state import RequestError
    from radixgen.runtime.media.processor import ProcessedImage

    _, _, eng = vl
    forged = ProcessedImage(torch.zeros(16, 1176), (1, 4, 6), 6, (84, 56))  # 24 patches' rows expected
    with pytest.raises(RequestError, match=r"grid \(1, 4, 6\) must have pixel values of shape \(24, 1176\)"):
        eng.generate(Prompt.of(BEFORE, MediaSegment("image", forged)), GREEDY)
    with pytest.raises(RequestError, match="holds the image placeholder token"):
        eng.generate(input_ids=BEFORE + [IMAGE_TOKEN] * 4, sampling_params=GREEDY)
    ok = eng.generate(Prompt.of(BEFORE, MediaSegment.image(random_image(8, 56, 56)), AFTER), {"max_new_tokens": 2})
    assert ok["meta_info"]["completion_tokens"] == 2 and eng.get_server_info()["invariant_ok"]


def test_select_after_an_image_scores_the_choices_over_the_cached_image_prefix(vl):
    """`select` after an image (M-RoPE positions continue after it): each choice's score equals its mean logprob
    by hand from transformers' forward over the same ids and pixels; the image's KV is reused for each choice."""
    import transformers as tf
    from tiny_vlm import choice_mean_logprobs

    import radixgen as rg
    from radixgen.lang.backend_engine import EngineBackend
    from radixgen.runtime.loader import read_hf_config
    from radixgen.runtime.media import processor_for

    arch, folder, eng = vl
    choices = ["yes", "no", "a red car"]

    @rg.function
    def qa(s, img):
        s += rg.user("Look. " + rg.image(img) + "Is it a cat?")
        s += rg.assistant(rg.select("a", choices=choices))

    img = random_image(9, 70, 110)
    state = qa.run(img=img, backend=EngineBackend(eng))
    meta = state.get_meta_info("a")
    text = state.text()
    mark = eng.model_info["image_token"]
    head, tail = text[: text.index(state["a"], text.index("Is it a cat?"))].split(mark)
    proc = processor_for(arch, read_hf_config(folder), folder)
    px = proc.process(img)
    tok = eng.tokenizer
    ids = tok(head).input_ids + proc.tokens(px).ids
    fulls = [ids + tok(tail + c, add_special_tokens=False).input_ids for c in choices]
    cls = {"qwen2_vl": tf.Qwen2VLForConditionalGeneration, "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration}[arch]
    ref = cls.from_pretrained(folder, dtype=torch.float32).eval()

    def logits_of(x):
        t = torch.tensor([x])
        return ref(input_ids=t, pixel_values=px.pixel_values, image_grid_thw=torch.tensor([px.grid]),
                   mm_token_type_ids=(t == IMAGE_TOKEN).int()).logits[0]

    with torch.no_grad():
        want = choice_mean_logprobs(logits_of, ids + tok(tail, add_special_tokens=False).input_ids, fulls)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
    assert state["a"] == choices[max(range(len(choices)), key=lambda i: want[i])]
    assert meta["cached_tokens"] >= len(choices) * len(ids)  # the text and the image from the tree, each choice
    assert eng.get_server_info()["invariant_ok"]
