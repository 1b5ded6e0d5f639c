"""Qwen2-VL through a real `radixgen serve` subprocess of a tiny random checkpoint (float32): /generate with
image_data and the OpenAI chat API with an image_url part (the `openai` client) give transformers' greedy output
for the same ids and pixels (tests/runtime/test_qwen2_vl_engine.py shows the in-process Engine gives it too);
the same image asked again is a cache hit, video input a 400 naming it."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_proc import start_server, stop_server  # noqa: E402
from tiny_vl_models import IMAGE_TOKEN, hf_greedy_ids, random_image, tiny_vl_dir  # noqa: E402

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
MARK = "<|vision_start|><|image_pad|><|vision_end|>"  # the model's image placeholder text


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server():
    srv = start_server("--model", str(tiny_vl_dir("qwen2_vl")), "--dtype", "float32", "--max-total-tokens", "2048")
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture(scope="module")
def ref():
    """transformers' model, the processor and the tokenizer of the checkpoint; greedy(text, image, first_special)
    -> (prompt ids, output ids), the text cut at the placeholder as the runtime cuts it."""
    import transformers as tf

    from radixgen.runtime.loader import read_hf_config
    from radixgen.runtime.media import processor_for

    folder = tiny_vl_dir("qwen2_vl")
    model = tf.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    proc = processor_for("qwen2_vl", read_hf_config(folder), folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)

    def greedy(text: str, image, first_special: bool = True) -> tuple[list[int], list[int]]:
        head, tail = text.split(MARK)
        px = proc.process(image)
        ids = (tok(head, add_special_tokens=first_special).input_ids + proc.tokens(px).ids
               + tok(tail, add_special_tokens=False).input_ids)
        return ids, hf_greedy_ids(model, px, ids, NEW)

    return greedy, tok


def test_generate_with_image_data_equals_transformers_and_reuses_the_image(server, ref):
    greedy, _ = ref
    img, other = random_image(1, 60, 90), random_image(2, 60, 90)
    text = "Describe: " + MARK + " in a few words."
    ids, want = greedy(text, img)
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["image_token"] == MARK and info["supports_images"] is True
        out = c.post("/generate", json={"text": text, "image_data": data_url(img), "sampling_params": GREEDY}).json()
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["output_ids"] == want
        # the same image after the same text, another question: its KV from the tree; a batch of it, another image
        # and a text-only prompt: each as alone
        again = c.post("/generate", json={"text": "Describe: " + MARK + " in one word.", "sampling_params": GREEDY,
                                          "image_data": data_url(img).split(",", 1)[1]})  # bare base64
        assert again.json()["meta_info"]["cached_tokens"] >= ids.index(IMAGE_TOKEN) + ids.count(IMAGE_TOKEN)
        batch = c.post("/generate", json={"text": [text, text, "No image here."], "sampling_params": GREEDY,
                                          "image_data": [data_url(img), data_url(other), None]}).json()
    assert batch[0]["output_ids"] == want
    assert batch[1]["output_ids"] == greedy(text, other)[1] != want


def test_openai_chat_with_an_image_url_part_equals_transformers(server, ref):
    import openai

    from radixgen.common.chat_render import render_chat

    greedy, tok = ref
    img = random_image(3, 84, 56)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key)
    r = client.chat.completions.create(
        model=server.model, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                               {"type": "image_url", "image_url": {"url": data_url(img),
                                                                                   "detail": "high"}}]}])
    # the template's text with the placeholder where the part was (its special tokens written: none added)
    text = render_chat(tok, [{"role": "user", "content": "What is this? " + MARK}])
    ids, want = greedy(text, img, first_special=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == NEW
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)


def test_video_input_is_a_400_naming_it(server):
    with server.client() as c:
        native = c.post("/generate", json={"text": "x", "video_data": "clip.mp4", "sampling_params": GREEDY})
        assert native.status_code == 400 and "video inputs (video_data) are" in native.json()["error"]["message"]
        chat = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]})
        assert chat.status_code == 400
        assert "video input (video_url parts) is not supported" in chat.json()["error"]["message"]
        ok = c.post("/generate", json={"text": "fine", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
