"""Image input on a tiny random LLaVA (CLIP tower + projector over a Llama or Qwen2 language model), written by
transformers' own classes: our logits against transformers' forward with the same pixel values (float32), greedy
output over 32 tokens, chunked prefill cutting through the image, batches mixing text and image requests, the
radix and encoder caches, retraction and abort, a JSON schema over an image question, and the bad inputs."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
import torch
from tiny_vlm import IMAGE_TOKEN_ID, hf_pixels, make_image, png_bytes, tiny_llava_dir

from radixgen.common.prompt import MediaItem, MediaSegment, Prompt
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.engine import Engine, RequestError
from radixgen.runtime.executor.model_runner import ForwardInput, ModelRunner, check_multimodal
from radixgen.runtime.loader import read_hf_config
from radixgen.runtime.media.processor import processor_for

GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
SHORT = {**GREEDY, "max_new_tokens": 8}
N_IMG = 16  # the tiny tower's patches: image tokens per image
KV_SLOTS = 200


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------- the model against transformers


@pytest.mark.parametrize("text,path", [("llama", "c"), ("llama", "torch"), ("qwen2", "c")])
def test_llava_logits_equal_transformers_whole_and_chunked_through_the_image(text, path):
    import transformers as tf

    d = tiny_llava_dir(text)
    proc = processor_for("llava", read_hf_config(d), d)
    img = make_image(1)
    item = proc.process(img)
    assert torch.equal(item.pixel_values, hf_pixels(d, img)[0])  # the same pixels as transformers' processor
    ids = [1, 100, 200] + [IMAGE_TOKEN_ID] * N_IMG + [300, 400, 500, 600]
    media = (MediaItem("image", proc.content_hash(item), 3, 3 + N_IMG, item),)
    hf = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=hf_pixels(d, img)).logits[0]
    runner = ModelRunner(RuntimeConfig(model=str(d), dtype="float32", max_total_tokens=256, max_running_requests=2,
                                       disable_cpu_kernels=path == "torch"), d)

    def run(row: int, lo: int, hi: int) -> torch.Tensor:
        slots = torch.arange(1, hi - lo + 1) + 64 * row + lo
        runner.req_to_slot[row, lo:hi] = slots
        fi = ForwardInput(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), slots, torch.tensor([row]), [lo], [hi - lo],
                          torch.arange(hi - lo), media=(media,))
        return runner.forward(fi)

    whole = run(0, 0, len(ids))
    assert rel_err(whole, ref) < 1e-4
    # chunks cut the image at 9 and 15: each chunk's rows take their rows of the (cached) image embedding
    chunks = torch.cat([run(1, 0, 9), run(1, 9, 15), run(1, 15, len(ids))])
    assert rel_err(chunks, ref) < 1e-4
    assert runner.encoder_cache.info()["encoded_items"] == 1  # encoded once, then from the encoder cache
    # two requests with other images and a text-only one in one step: one encoder call for both images, and each
    # request's logits as when it ran alone
    other = proc.process(make_image(2))
    media2 = (MediaItem("image", proc.content_hash(other), 3, 3 + N_IMG, other),)
    text = [1, 5, 6, 7]
    runner.req_to_slot[0, :len(ids)] = torch.arange(1, len(ids) + 1)
    runner.req_to_slot[1, :len(ids)] = torch.arange(1, len(ids) + 1) + 64
    runner.encoder_cache.clear()
    before = runner.encoder_cache.info()
    fi = ForwardInput(torch.tensor(ids + ids + text), torch.cat([torch.arange(len(ids))] * 2 + [torch.arange(4)]),
                      torch.cat([torch.arange(1, len(ids) + 1), torch.arange(1, len(ids) + 1) + 64,
                                 torch.arange(200, 204)]), torch.tensor([0, 1, 2]), [0, 0, 0], [len(ids)] * 2 + [4],
                      torch.arange(2 * len(ids) + 4), media=(media, media2, ()))
    runner.req_to_slot[2, :4] = torch.arange(200, 204)
    both = runner.forward(fi)
    after = runner.encoder_cache.info()
    assert after["encode_calls"] == before["encode_calls"] + 1
    assert after["encoded_items"] == before["encoded_items"] + 2
    assert rel_err(both[:len(ids)], ref) < 1e-4
    with torch.no_grad():
        ref2 = hf(input_ids=torch.tensor([ids]), pixel_values=hf_pixels(d, make_image(2))).logits[0]
        ref3 = hf.model.language_model  # the text-only request through transformers' language model
        ref3 = hf.lm_head(ref3(input_ids=torch.tensor([text])).last_hidden_state)[0]
    assert rel_err(both[len(ids):2 * len(ids)], ref2) < 1e-4
    assert rel_err(both[2 * len(ids):], ref3) < 1e-4


def test_a_multimodal_model_refuses_lora_a_draft_model_and_parallelism_naming_the_combination():
    with pytest.raises(ValueError, match=r"tp_size=2, pp_size=1\) with a vision-language model \(llava\)"):
        check_multimodal(RuntimeConfig(tp_size=2), "llava")
    with pytest.raises(ValueError, match=r"LoRA adapters with a vision-language model \(llava\)"):
        check_multimodal(RuntimeConfig(enable_lora=True), "llava")
    with pytest.raises(ValueError, match=r"speculative_algorithm='draft' with a vision-language model"):
        check_multimodal(RuntimeConfig(speculative_draft_model="x"), "llava")


# ---------------------------------------------------------------- the Engine


@pytest.fixture(scope="module")
def llm():
    # chunks of 8 tokens: every image prompt's prefill is cut inside its image. The offline LLM's Engine serves
    # the Engine-level tests too (one scheduler process for the module).
    from radixgen.offline import LLM

    model = LLM(str(tiny_llava_dir()), dtype="float32", max_total_tokens=KV_SLOTS, max_running_requests=8,
                chunked_prefill_size=8, max_images_per_request=2, max_image_pixels=96 * 96)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def engine(llm) -> Engine:
    return llm.engine


def idle_and_consistent(engine: Engine) -> None:
    for _ in range(200):  # an abort is handled at the scheduler's next step
        info = engine.get_server_info()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        time.sleep(0.05)
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["invariant_ok"] is True


def hf_greedy(img, prompt_ids: list[int], n: int = 32) -> list[int]:
    import transformers as tf

    d = tiny_llava_dir()
    hf = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    out = hf.generate(input_ids=torch.tensor([prompt_ids]), pixel_values=hf_pixels(d, img), max_new_tokens=n,
                      do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_32_tokens_equal_transformers_with_chunked_prefill_through_the_image(engine):
    img = make_image(2)
    tok = engine.tokenizer
    ids = tok("USER: ").input_ids + [IMAGE_TOKEN_ID] * N_IMG + tok("\nWhat is it?", add_special_tokens=False).input_ids
    expected = hf_greedy(img, ids)
    assert engine.model_info["image_token"] == "<image>" and engine.model_info["supports_images"]
    for source in (img, "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()):
        engine.flush_cache()
        out = engine.generate("USER: <image>\nWhat is it?", GREEDY, image_data=source)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["output_ids"] == expected
    # a Prompt with a media segment is the same request
    out = engine.generate(Prompt.of("USER: ", MediaSegment.image(img), "\nWhat is it?"), GREEDY)
    assert out["output_ids"] == expected
    idle_and_consistent(engine)


def test_a_batch_mixing_text_and_image_requests_equals_each_alone(engine):
    a, b = make_image(3), make_image(4)
    prompts = ["Hello there, how", "USER: <image>\nDescribe it.", "<image> and <image>: which?", "Plain text."]
    images = [None, a, [a, b], None]
    params = {**GREEDY, "max_new_tokens": 12}
    engine.flush_cache()
    alone = []
    for p, i in zip(prompts, images, strict=True):
        alone.append(engine.generate(p, params, image_data=i)["output_ids"])
        engine.flush_cache()
    together = engine.generate(prompts, params, image_data=images)
    assert [o["output_ids"] for o in together] == alone
    assert alone[1] != alone[2]  # the images matter
    idle_and_consistent(engine)


def test_a_repeated_image_hits_both_caches_and_a_different_image_hits_neither(engine):
    a, b = make_image(5), make_image(6)
    engine.flush_cache()
    encoded = engine.get_server_info()["encoder_cache"]["encoded_items"]  # counts since start
    first = engine.generate("USER: <image>\nWhat colour?", SHORT, image_data=a)
    head = len(engine.tokenize(["USER: "])[0])
    # the same image, another question: its KV comes from the tree (up to where the prompts part)
    again = engine.generate("USER: <image>\nHow big?", SHORT, image_data=png_bytes(a))
    assert again["meta_info"]["cached_tokens"] >= head + N_IMG
    # another image after the same text: only the text is shared, and it is encoded
    other = engine.generate("USER: <image>\nWhat colour?", SHORT, image_data=b)
    assert other["meta_info"]["cached_tokens"] == head
    assert other["output_ids"] != first["output_ids"]
    enc = engine.get_server_info()["encoder_cache"]
    assert enc["encoded_items"] == encoded + 2
    # the first image after other text: not in the tree, but its embeddings come from the encoder cache
    third = engine.generate("Look: <image> now answer.", SHORT, image_data=a)
    assert third["meta_info"]["cached_tokens"] < 3
    enc2 = engine.get_server_info()["encoder_cache"]
    assert enc2["encoded_items"] == encoded + 2 and enc2["hits"] > enc["hits"]
    previews = [n.text or "" for n in engine.get_radix_tree(preview_chars=60).nodes]
    assert any("[image]" in p for p in previews)  # an image's key ids are shown as one mark, never decoded
    idle_and_consistent(engine)


def test_retraction_and_abort_with_images_leak_nothing(engine):
    imgs = [make_image(10 + k) for k in range(4)]
    prompts = [f"Question {k}: <image> ?" for k in range(4)]  # no shared prefix: admitted together
    # ~22 + 90 slots each: any two running to the end overflow the pool's 200, so a retraction does not depend on
    # how closely the four arrive (their images are processed in the front end one after another)
    params = {**GREEDY, "max_new_tokens": 90}
    alone = []
    for p, i in zip(prompts, imgs, strict=True):
        engine.flush_cache()
        alone.append(engine.generate(p, params, image_data=i)["output_ids"])
    engine.flush_cache()
    before = engine.get_server_info()["stats"]["retractions"]
    together = engine.generate(prompts, params, image_data=imgs)
    assert engine.get_server_info()["stats"]["retractions"] > before
    assert [o["output_ids"] for o in together] == alone

    async def aborted():
        it = await engine.async_generate("USER: <image>\nGo on.", {**GREEDY, "max_new_tokens": 150}, stream=True,
                                         image_data=imgs[0])
        async for _ in it:
            break  # leaving the stream aborts the request

    asyncio.run(aborted())
    idle_and_consistent(engine)


def test_a_json_schema_constrains_the_answer_to_an_image_question(engine):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"]}
    out = engine.generate("USER: <image>\nThe colour as JSON:", {"max_new_tokens": 40, "temperature": 0.0,
                                                               "json_schema": json.dumps(schema)},
                          image_data=make_image(7))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(out["text"])["colour"], str)


@pytest.mark.parametrize("prompt,image_data,message", [
    ("<image>", b"not an image", r"prompt image 0: cannot decode the image data \(12 bytes\)"),
    ("<image>", "data:image/png;base64", r"malformed data URL"),
    ("<image>", "data:text/plain;base64,aGVsbG8=", r"media type 'text/plain' is not an image type"),
    ("<image>", "https://example.com/cat.png", r"http\(s\) URLs are not fetched on this server"),
    ("<image><image><image>", [make_image(0)] * 3, r"3 images, more than the limit of 2 per request"),
    ("<image><image>", [make_image(0)], r"2 image placeholders \('<image>'\) for 1 images"),
    ("<image>", make_image(0, (100, 100)), r"100x100 = 10000 pixels, more than the limit of 9216"),
    ("<image>", "@@@ not base64 @@@", r"neither a file path, a URL nor valid base64"),
    ("<image>", 12, r"expected a path, bytes, a data URL, base64 text or a PIL image, got int"),
    ("a <image> b", None, r"prompt: holds the image placeholder token \(id 49152\) where no image is given"),
])
def test_bad_images_are_request_errors_naming_the_problem(engine, prompt, image_data, message):
    with pytest.raises(RequestError, match=message):
        engine.generate(prompt, GREEDY, image_data=image_data)
    with pytest.raises(RequestError, match=message):
        asyncio.run(engine.async_generate(prompt, GREEDY, image_data=image_data))
    ok = engine.generate("USER: <image>\nFine?", {**GREEDY, "max_new_tokens": 2}, image_data=make_image(0))
    assert ok["meta_info"]["completion_tokens"] == 2
    idle_and_consistent(engine)


def test_image_data_of_a_batch_has_one_entry_per_prompt(engine):
    with pytest.raises(RequestError, match=r"for 2 prompts, give a list with one entry per prompt"):
        engine.generate(["a <image>", "b"], GREEDY, image_data=[make_image(0)])
    with pytest.raises(RequestError, match=r"prompt\[1\]: holds the image placeholder token"):
        engine.generate(input_ids=[[1, 2], [1, IMAGE_TOKEN_ID]], sampling_params=GREEDY)
    from radixgen.runtime.media.processor import ProcessedImage

    forged = ProcessedImage(torch.zeros(3, 8, 8), (1, 1), 1, (8, 8))
    with pytest.raises(RequestError, match=r"prompt image 0: a processed image must have pixel values of shape "
                                           r"\(3, 32, 32\) and 16 tokens"):
        engine.generate(Prompt.of("x", MediaSegment("image", forged)), GREEDY)
    with pytest.raises(RequestError, match=r"image_data: goes with a text prompt, not input_ids"):
        engine.generate(input_ids=[1, 2], sampling_params=GREEDY, image_data=make_image(0))


# ---------------------------------------------------------------- the offline API (vLLM's shapes)


def test_offline_generate_with_multi_modal_data_and_chat_with_image_parts(llm, engine):
    from radixgen.offline import SamplingParams

    img = make_image(8)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = engine.generate("USER: <image>\nWhat is it?", {**GREEDY, "max_new_tokens": 8}, image_data=img)
    (out,) = llm.generate({"prompt": "USER: <image>\nWhat is it?", "multi_modal_data": {"image": img}}, sp,
                          use_tqdm=False)
    assert out.outputs[0].token_ids == expected["output_ids"]
    assert len(out.prompt_token_ids) == expected["meta_info"]["prompt_tokens"]
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == N_IMG
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                               + base64.b64encode(png_bytes(img)).decode()}}]}]
    (chat,) = llm.chat(messages, sp, use_tqdm=False)
    (pil,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                    {"type": "image_pil", "image_pil": img}]}], sp, use_tqdm=False)
    assert chat.outputs[0].token_ids == pil.outputs[0].token_ids
    assert chat.prompt_token_ids.count(IMAGE_TOKEN_ID) == N_IMG
    with pytest.raises(ValueError, match=r"multi_modal_data takes \{'image': ...\}, got \['video'\]"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": img}}, sp, use_tqdm=False)
    with pytest.raises(RequestError, match=r"cannot decode the image data"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"junk"}}, sp, use_tqdm=False)


# ---------------------------------------------------------------- the DSL: select after an image


def test_select_after_an_image_scores_the_choices_over_the_cached_image_prefix(engine):
    """`select` after an image: each choice's score equals its mean logprob computed by hand from transformers'
    forward over the same ids and pixels; the image's KV comes from the radix tree for every choice."""
    import transformers as tf
    from tiny_vlm import choice_mean_logprobs

    import radixgen as rg
    from radixgen.lang.backend_engine import EngineBackend

    choices = ["yes", "no", "a dog"]

    @rg.function
    def qa(s, img):
        s += rg.user(rg.image(img) + "Is it a cat?")
        s += rg.assistant(rg.select("a", choices=choices))
        s += rg.user("Why?") + rg.assistant(rg.gen("why", max_tokens=4, temperature=0))

    d = tiny_llava_dir()
    hf = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    backend, tok = EngineBackend(engine), engine.tokenizer
    engine.flush_cache()
    scores = []
    for seed in (30, 31):
        img = make_image(seed)
        state = qa.run(img=img, backend=backend)
        meta = state.get_meta_info("a")
        text = state.text()
        prompt = text[: text.index(state["a"], text.index("Is it a cat?"))]  # the text the choices follow
        head, tail = prompt.split("<image>")
        ids = tok(head).input_ids + [IMAGE_TOKEN_ID] * N_IMG
        fulls = [ids + tok(tail + c, add_special_tokens=False).input_ids for c in choices]
        with torch.no_grad():
            px = hf_pixels(d, img)
            want = choice_mean_logprobs(lambda x, px=px: hf(input_ids=torch.tensor([x]), pixel_values=px).logits[0],
                                        ids + tok(tail, add_special_tokens=False).input_ids, fulls)
        assert meta["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
        assert state["a"] == choices[max(range(3), key=lambda i: want[i])]
        assert meta["cached_tokens"] >= len(choices) * (len(ids))  # each choice: the image's KV from the tree
        assert state["why"]
        scores.append(meta["normalized_prompt_logprobs"])
    assert scores[0] != scores[1]  # the image reached the scoring

    @rg.function
    def unconditional(s, img):  # the "no context" prompt holds no image: scored as text beside the image prompt
        s += rg.user(rg.image(img) + "Is it a cat?")
        s += rg.assistant(rg.select("a", choices=choices, choices_method=rg.unconditional_likelihood_normalized))

    meta = unconditional.run(img=make_image(31), backend=backend).get_meta_info("a")
    assert [t[0] for t in meta["input_token_logprobs"][0]] == pytest.approx(
        [t[0] for t in state.get_meta_info("a")["input_token_logprobs"][0]], abs=1e-5)
    assert len(meta["unconditional_token_logprobs"]) == len(choices)
    idle_and_consistent(engine)


def test_the_encoder_cache_is_shared_only_within_a_cache_salt(engine):
    """Issue 46: under per-key isolation every request carries its key's namespace as its cache salt; an image's
    embeddings are kept per salt, so one key cannot learn from the encoder cache (its counts in /server_info, or
    the time an encoding takes) whether another key sent an image."""
    img = make_image(41)
    engine.generate("USER: <image>\nWhat colour?", SHORT, image_data=img, cache_salt="key-a")
    before = engine.get_server_info()["encoder_cache"]
    engine.generate("Look: <image> now.", SHORT, image_data=img, cache_salt="key-b")
    after = engine.get_server_info()["encoder_cache"]
    assert after["encoded_items"] == before["encoded_items"] + 1  # encoded again: key-a's entry is not key-b's
    engine.generate("Again: <image> now.", SHORT, image_data=img, cache_salt="key-b")
    assert engine.get_server_info()["encoder_cache"]["encoded_items"] == after["encoded_items"]  # shared in a salt
    idle_and_consistent(engine)
