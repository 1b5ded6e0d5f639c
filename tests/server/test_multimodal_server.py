"""Image input through a real `radixgen serve` subprocess of a tiny random LLaVA: native /generate image_data,
the OpenAI chat API through the `openai` client with image_url parts, remote images fetched from a loopback
HTTP server (--allow-remote-media, with its size limit), the DSL over RuntimeEndpoint, SGLang's own frontend
with sgl.image, and bad images answered with a 400 naming the problem while other requests go on. The server
runs n-gram speculation in float32: an image request's greedy output equals transformers' generate."""

from __future__ import annotations

import base64
import http.server
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_proc import start_server, stop_server  # noqa: E402
from tiny_vlm import make_image, png_bytes, tiny_llava_dir  # noqa: E402

import radixgen as rg  # noqa: E402

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
N_IMG = 16
MAX_BYTES = 4000  # a 48x40 random PNG is about 5.8 KB; a 16x16 one about 0.8 KB


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """The folder whose images clients may name by path (--allowed-local-media-path)."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def server(media_dir):
    srv = start_server("--model", str(tiny_llava_dir()), "--max-total-tokens", "2048", "--allow-remote-media",
                       "--dtype", "float32", "--speculative-algorithm", "ngram",
                       "--max-media-bytes", str(MAX_BYTES), "--max-images-per-request", "2",
                       "--allowed-local-media-path", str(media_dir))
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server of two PNGs: /small.png (under the byte limit) and /big.png (over it); /slow.png
    answers after 2 s."""
    files = {"/small.png": png_bytes(make_image(21, (16, 16))), "/big.png": png_bytes(make_image(22, (48, 40)))}
    assert len(files["/small.png"]) < MAX_BYTES < len(files["/big.png"])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/slow.png":
                time.sleep(2.0)
            body = files.get("/small.png" if self.path == "/slow.png" else self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def small(seed: int):
    return make_image(seed, (16, 16))  # under MAX_BYTES as a PNG


def test_generate_with_image_data_reuses_the_cache_and_tells_images_apart(server):
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["image_token"] == "<image>" and info["supports_images"] is True
        body = {"text": "USER: <image>\nWhat is it?", "sampling_params": GREEDY}
        a = c.post("/generate", json={**body, "image_data": data_url(small(1))}).json()
        b64 = base64.b64encode(png_bytes(small(1))).decode()
        again = c.post("/generate", json={**body, "image_data": b64}).json()
        assert again["output_ids"] == a["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= N_IMG  # the image's KV from the radix tree
        batch = c.post("/generate", json={"text": ["<image> one", "<image> two", "no image"], "sampling_params": GREEDY,
                                          "image_data": [data_url(small(2)), data_url(small(3)), None]}).json()
        assert [r["meta_info"]["prompt_tokens"] for r in batch][:2] == [batch[0]["meta_info"]["prompt_tokens"]] * 2
        assert batch[0]["output_ids"] != batch[1]["output_ids"]


def test_ngram_speculation_over_an_image_prompt_keeps_the_greedy_output(server):
    import torch
    import transformers as tf
    from tiny_vlm import IMAGE_TOKEN_ID, hf_pixels

    d = tiny_llava_dir()
    img = small(11)
    tok = tf.AutoTokenizer.from_pretrained(d)
    tail = "\nSay: a b c a b c a b c a b c a b c"
    ids = tok("USER: ").input_ids + [IMAGE_TOKEN_ID] * N_IMG + tok(tail, add_special_tokens=False).input_ids
    hf = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    expected = hf.generate(input_ids=torch.tensor([ids]), pixel_values=hf_pixels(d, img), max_new_tokens=24,
                           do_sample=False)[0, len(ids):].tolist()
    with server.client() as c:
        out = c.post("/generate", json={"text": "USER: <image>" + tail, "image_data": data_url(img),
                                        "sampling_params": {**GREEDY, "max_new_tokens": 24}}).json()
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["output_ids"] == expected
    assert out["meta_info"]["spec_verify_ct"] > 0  # verification passes ran


def test_openai_chat_with_an_image_url_part(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key)

    def ask(img, detail="low"):
        return client.chat.completions.create(model=server.model, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": data_url(img), "detail": detail}}]}])

    text_only = client.chat.completions.create(model=server.model, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "What is in this picture?"}])
    a, b = ask(small(4)), ask(small(5), "high")
    assert a.usage.prompt_tokens == text_only.usage.prompt_tokens + N_IMG
    assert a.choices[0].message.content != b.choices[0].message.content
    assert ask(small(4), "auto").choices[0].message.content == a.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match=r"image_url.detail must be one of"):
        ask(small(4), "ultra")


def test_anthropic_and_ollama_image_inputs_answer_as_the_openai_chat(server):
    """An image as Anthropic's base64 image block and as an Ollama message's `images`: the same prompt, the same
    greedy answer as the OpenAI chat's image_url part; count_tokens counts the image's tokens."""
    import anthropic
    import ollama
    import openai

    img, question = small(6), "What is in this picture?"
    b64 = base64.b64encode(png_bytes(img)).decode()
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key).chat.completions.create(
        model=server.model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
            {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": data_url(img)}}]}])
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    blocks = [{"type": "text", "text": question},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]
    msg = claude.messages.create(model=server.model, max_tokens=8, messages=[{"role": "user", "content": blocks}],
                                 extra_body={"temperature": 0.0})
    assert msg.content[0].text == oai.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == oai.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=server.model, messages=[{"role": "user", "content": blocks}])
    assert counted.input_tokens == oai.usage.prompt_tokens
    llama = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {server.api_key}"})
    reply = llama.chat(model=server.model, messages=[{"role": "user", "content": question, "images": [b64]}],
                       options={"temperature": 0, "num_predict": 8})
    assert reply.message.content == oai.choices[0].message.content


def test_remote_images_are_fetched_within_the_size_limit(server, image_host):
    with server.client() as c:
        ok = c.post("/generate", json={"text": "<image> Describe.", "sampling_params": GREEDY,
                                       "image_data": f"{image_host}/small.png"})
        assert ok.status_code == 200, ok.text
        big = c.post("/generate", json={"text": "<image> Describe.", "sampling_params": GREEDY,
                                        "image_data": f"{image_host}/big.png"})
        assert big.status_code == 400 and f"larger than the limit of {MAX_BYTES} bytes" in big.text
        gone = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_host}/none.png"}}]}]})
        assert gone.status_code == 400 and "answered HTTP 404" in gone.json()["error"]["message"]
    from radixgen.common.media import MediaError, load_image

    with pytest.raises(MediaError, match=r"fetching .*/slow.png took longer than the limit of 0.3 s"):
        load_image(f"{image_host}/slow.png", allow_remote=True, timeout_s=0.3)


def test_hanging_image_hosts_hold_up_only_their_own_requests(server):
    """Issue 46 item 5: image fetches run on their own bounded pool. While 9 requests wait on 18 image URLs that
    hang (more than the pool's 16 fetches: the rest are refused at once with a 503 media_fetch_busy), text requests
    are tokenized and answered; released, the waiting image requests finish."""
    from radixgen.runtime.engine.media_fetch import FETCH_WORKERS

    release, arrived, lock = threading.Event(), [], threading.Lock()
    image = png_bytes(small(7))

    class Hang(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            with lock:
                arrived.append(self.path)
            release.wait(60)  # bounded: the test releases it
            self.send_response(200)
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hang)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{httpd.server_address[1]}"
    results: dict[int, tuple[int, dict]] = {}

    def image_request(i: int) -> None:
        with server.client() as c:
            r = c.post("/generate", json={"text": "<image><image> Describe.", "sampling_params": GREEDY,
                                          "image_data": [f"{host}/{i}-a.png", f"{host}/{i}-b.png"]})
            results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=image_request, args=(i,)) for i in range(9)]
    try:
        for t in threads:
            t.start()
        for _ in range(600):  # every fetch thread is busy with the hanging host (bounded wait)
            with lock:
                if len(arrived) >= FETCH_WORKERS:
                    break
            time.sleep(0.1)
        assert len(arrived) == FETCH_WORKERS
        with server.client() as c:
            for _ in range(3):  # text requests go through while every fetch hangs
                r = c.post("/generate", json={"text": "One, two,", "sampling_params": GREEDY})
                assert r.status_code == 200, r.text
            r = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
        assert not release.is_set() and len(arrived) == FETCH_WORKERS  # the hanging fetches are still hanging
        busy = [body for status, body in results.values() if status == 503]
        assert busy and all(b["error"]["code"] == "media_fetch_busy" for b in busy), results
    finally:
        release.set()
        for t in threads:
            t.join(120)
        httpd.shutdown()
    assert len(results) == 9
    for status, body in results.values():  # served, refused at once, or (a very slow machine) past the fetch deadline
        assert status == 200 or body["error"]["code"] == "media_fetch_busy" or (
            status == 400 and "took longer than the limit" in body["error"]["message"]), body


@pytest.mark.parametrize("image_data,message", [
    ("data:image/png;base64,!!!", "neither a file path, a URL nor valid base64"),
    ("data:image/png,abc", "a data URL must be base64-encoded"),
    (base64.b64encode(b"not an image at all").decode(), "cannot decode the image data"),
    (["x", "y", "z"], "3 images, more than the limit of 2 per request"),
])
def test_bad_images_are_400s_naming_the_problem(server, image_data, message):
    with server.client() as c:
        r = c.post("/generate", json={"text": "<image>", "sampling_params": GREEDY, "image_data": image_data})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        chat = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data if isinstance(
                image_data, str) else "data:,"}}]}]})
        assert chat.status_code == 400, chat.text
        ok = c.post("/generate", json={"text": "<image> fine", "sampling_params": GREEDY,
                                       "image_data": data_url(small(6))})
        assert ok.status_code == 200
        assert c.get("/server_info").json()["encoder_cache"]["entries"] >= 1


def test_the_dsl_over_runtime_endpoint_sends_images_and_forks_keep_them(server):
    backend = rg.RuntimeEndpoint(server.url, api_key=server.api_key)
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

    @rg.function
    def describe(s, img):
        s += "Look: " + rg.image(img) + " Now: "  # an image in plain text
        s += rg.user(rg.image(img) + "Describe it.")  # and inside a role
        s += rg.assistant(rg.gen("answer", **params))
        branches = s.fork(2)
        for k, f in enumerate(branches):
            f += rg.user(f"Detail {k}?") + rg.assistant(rg.gen("detail", **params))
        s["texts"] = [f.text() for f in branches]
        s["details"] = [f["detail"] for f in branches]

    state = describe.run(img=small(7), backend=backend)
    assert state.text().count("<image>") == 2 and state["answer"]
    other = describe.run(img=small(8), backend=backend)
    assert other["answer"] != state["answer"]  # the image reached the model
    with server.client() as c:  # each branch's request carried both images: the same text sent with them
        for text, detail in zip(state["texts"], state["details"], strict=True):
            prompt = text[: text.rindex(detail)]
            direct = c.post("/generate", json={"text": prompt, "image_data": [data_url(small(7))] * 2,
                                               "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True}}).json()
            assert direct["text"] == detail
    backend.shutdown()


def test_sglang_programs_with_sgl_image_run_unchanged(server, tmp_path):
    sgl = pytest.importorskip("sglang", reason="SGLang's frontend (pip install --no-deps sglang) is not installed")
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(small(9)))

    @sgl.function
    def image_qa(s, image_file, question):
        s += sgl.user(sgl.image(image_file) + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))

    backend = sgl.RuntimeEndpoint(server.url, api_key=server.api_key)
    state = image_qa.run(image_file=str(path), question="What is this?", backend=backend)
    assert isinstance(state["answer"], str)
    with server.client() as c:
        direct = c.post("/generate", json={"text": state.text()[: state.text().rindex(state["answer"])],
                                           "image_data": base64.b64encode(path.read_bytes()).decode(),
                                           "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert direct["text"] == state["answer"]


def test_the_dsl_openai_backend_sends_images_as_image_url_parts(server):
    """rg.image under the language's OpenAI backend: each image goes to the chat API as an image_url part (a data
    URL) in its place in the message; the answer is the one the `openai` client gets for those parts."""
    import openai

    from radixgen.lang.interpreter.errors import ProgramError

    backend = rg.OpenAI(server.model, base_url=f"{server.url}/v1", api_key=server.api_key)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key)

    @rg.function
    def describe(s, img):
        s += rg.system("You describe pictures.")
        s += rg.user("Look: " + rg.image(img) + " What is it?")
        s += rg.assistant(rg.gen("answer", max_tokens=6, temperature=0, ignore_eos=True))

    answers = []
    for seed in (12, 13):
        state = describe.run(img=png_bytes(small(seed)), backend=backend)
        direct = client.chat.completions.create(
            model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, messages=[
                {"role": "system", "content": "You describe pictures."},
                {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": data_url(small(seed))}},
                                             {"type": "text", "text": " What is it?"}]}])
        assert state["answer"] == direct.choices[0].message.content
        assert state.get_meta_info("answer")["prompt_tokens"] == direct.usage.prompt_tokens
        answers.append(state["answer"])
    assert answers[0] != answers[1]  # the image reached the model

    @rg.function
    def outside(s, img):
        s += rg.image(img)

    with pytest.raises(ProgramError, match=r"ValueError: image\(\): with a chat model an image goes inside a turn"):
        outside.run(img=small(12), backend=backend)
    completions = rg.OpenAI(server.model, is_chat_model=False, base_url=f"{server.url}/v1", api_key=server.api_key)
    with pytest.raises(ProgramError, match=r"the completions API of .* takes no images; use a chat model"):
        describe.run(img=small(12), backend=completions)
    backend.shutdown()
    completions.shutdown()


def test_select_after_an_image_over_runtime_endpoint(server, tmp_path):
    """select after an image over HTTP (the pieces tokenized by /tokenize): each choice's score is its mean logprob
    read off a /generate of the prompt and the choice with the image, every prompt logprob asked for (no cache
    use); the image given as a path and as a data URL scores the same."""
    backend = rg.RuntimeEndpoint(server.url, api_key=server.api_key)
    choices = ["yes", "no"]

    @rg.function
    def qa(s, img):
        s += rg.user(rg.image(img) + "Is it a cat?")
        s += rg.assistant(rg.select("a", choices=choices))

    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(small(14)))
    state = qa.run(img=str(path), backend=backend)
    meta = state.get_meta_info("a")
    assert meta["cached_tokens"] >= len(choices) * N_IMG  # the image's KV from the tree for each choice
    text = state.text()
    prompt = text[: text.index(state["a"], text.index("Is it a cat?"))]
    with server.client() as c:
        tok = c.post("/tokenize", json={"text": [prompt.split("<image>")[1]], "add_special_tokens": False}).json()
        want = []
        for choice in choices:
            out = c.post("/generate", json={"text": prompt + choice, "image_data": data_url(small(14)),
                                            "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                            "logprob_start_len": 0}).json()
            full = out["meta_info"]["input_token_logprobs"]
            tail = c.post("/tokenize", json={"text": [prompt.split("<image>")[1] + choice],
                                             "add_special_tokens": False}).json()[0]["tokens"]
            k = next(i for i, t in enumerate(tail) if i >= len(tok[0]["tokens"]) or t != tok[0]["tokens"][i])
            span = [lp for lp, _, _ in full[len(full) - (len(tail) - k):]]
            want.append(sum(span) / len(span))
    assert meta["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
    as_url = qa.run(img=data_url(small(14)), backend=backend)
    assert as_url.get_meta_info("a")["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
    backend.shutdown()


def test_a_client_names_local_files_only_under_the_allowed_folder(server, media_dir, tmp_path):
    """A path in image_data or an image_url is read only under --allowed-local-media-path: there it is the same
    image as its data URL; elsewhere (or climbing out with ..) a 400, whether the file exists or not."""
    (media_dir / "cat.png").write_bytes(png_bytes(small(15)))
    (tmp_path / "secret.png").write_bytes(png_bytes(small(16)))
    body = {"text": "<image> What is it?", "sampling_params": GREEDY}
    with server.client() as c:
        want = c.post("/generate", json={**body, "image_data": data_url(small(15))}).json()["output_ids"]
        got = c.post("/generate", json={**body, "image_data": str(media_dir / "cat.png")})
        assert got.status_code == 200 and got.json()["output_ids"] == want
        for path in (tmp_path / "secret.png", media_dir / ".." / tmp_path.name / "secret.png", tmp_path / "no.png"):
            r = c.post("/generate", json={**body, "image_data": str(path)})
            assert r.status_code == 400 and "outside the folder this server reads images from" in r.text, r.text
        chat = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/secret.png"}}]}]})
        assert chat.status_code == 400 and "outside the folder" in chat.json()["error"]["message"]
