"""LoRA adapters through a real `radixgen serve` subprocess (the tiny Llama, float32, two adapters at start and
two pool slots): /generate's lora_name (and lora_path, SGLang's name of it), the OpenAI API's model names and
/v1/models, /load_lora_adapter and /unload_lora_adapter under traffic, the errors, the frontend language over
HTTP, and the router's key."""

from __future__ import annotations

import threading

import pytest
from lora_helpers import base_model, greedy, make_adapter
from server_proc import start_server, stop_server
from tiny_models import tiny_model_dir

import radixgen as rg
from radixgen.router.proxy import prompt_text

PROMPT = [5, 9, 13, 17, 21, 400, 7, 8]
NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    models = {"a": make_adapter("llama", root / "a", rank=4, seed=1),
              "b": make_adapter("llama", root / "b", rank=8, seed=2, targets=("q_proj", "v_proj", "down_proj")),
              "c": make_adapter("llama", root / "c", rank=6, seed=3)}
    want = {None: greedy(base_model("llama"), PROMPT, NEW), **{n: greedy(m, PROMPT, NEW) for n, m in models.items()}}
    return root, want


@pytest.fixture(scope="module")
def lora_server(adapters):
    root, _ = adapters
    srv = start_server("--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--max-loras", "2",
                       "--lora-paths", f"a={root / 'a'}", str(root / "b"), "--lora-target-modules", "all",
                       api_key=None)
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()


@pytest.fixture
def http(lora_server):
    with lora_server.client() as c:
        yield c


def gen(http, lora, prompt=PROMPT, **extra):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            "lora_path": lora, **extra}
    return http.post("/generate", json=body)


def test_generate_with_lora_path_equals_peft(http, adapters):
    _, want = adapters
    for lora in (None, "a", "b"):
        r = gen(http, lora)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want[lora], lora
    r = http.post("/generate", json={"input_ids": [PROMPT] * 3, "lora_path": ["b", None, "a"],
                                     "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert [o["output_ids"] for o in r.json()] == [want["b"], want[None], want["a"]]


def test_lora_name_and_its_sglang_alias(http, adapters):
    """A request names its adapter with lora_name; SGLang's lora_path is the same field (an adapter's name, not a
    folder) on /generate and in the OpenAI extra body; both given and different is a 400."""
    _, want = adapters
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": PROMPT, "lora_name": "a", "sampling_params": sp})
    assert r.status_code == 200 and r.json()["output_ids"] == want["a"], r.text
    r = http.post("/generate", json={"input_ids": [PROMPT] * 2, "lora_name": [None, "b"], "lora_path": [None, "b"],
                                     "sampling_params": sp})
    assert [o["output_ids"] for o in r.json()] == [want[None], want["b"]], r.text
    r = http.post("/generate", json={"input_ids": PROMPT, "lora_name": "a", "lora_path": "b", "sampling_params": sp})
    assert r.status_code == 400 and "different adapters" in r.text, r.text
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    by_name = http.post("/v1/completions", json={**body, "lora_name": "b"}).json()
    by_path = http.post("/v1/completions", json={**body, "lora_path": "b"}).json()
    assert by_name["model"] == by_path["model"] == "b"
    assert by_name["choices"][0]["text"] == by_path["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "lora_name": "zz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text


def test_openai_model_names_select_adapters(http, lora_server, adapters):
    _, want = adapters
    base = lora_server.model
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [base, "a", "b"]
    assert models[1]["parent"] == base and models[1]["root"].endswith("/a")
    assert http.get("/v1/models/b").json()["id"] == "b"
    for model, lora in (("a", "a"), (f"{base}:b", "b"), (base, None)):
        r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == (lora or base)
        text = http.post("/detokenize", json={"tokens": want[lora]}).json()["text"]
        assert body["choices"][0]["text"] == text, model
    r = http.post("/v1/chat/completions", json={"model": "b", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and '"model":"b"' in r.text.replace(" ", "")


@pytest.mark.parametrize("route,body,status,words", [
    ("/generate", {"text": "x", "lora_path": "zz"}, 400, "unknown LoRA adapter 'zz'"),
    ("/v1/completions", {"model": "zz", "prompt": "x"}, 404, "`zz` does not exist"),
    ("/v1/completions", {"model": "llama:zz", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": "a", "lora_path": "b", "prompt": "x"}, 400, "differs from the adapter"),
    ("/v1/chat/completions", {"model": "llama", "lora_path": "zz", "messages": [{"role": "user", "content": "x"}]},
     400, "unknown LoRA adapter 'zz'"),
    ("/generate", {"text": "x", "lora_id": "7"}, 400, "lora_id"),
    ("/load_lora_adapter", {"lora_name": "n", "lora_path": "/nonexistent/folder"}, 400, "no adapter_config.json"),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, 400, "'a' is already loaded"),
    ("/load_lora_adapter", {"lora_name": "n", "lora_path": "/x", "lora_id": "1"}, 400, "lora_id"),
    ("/unload_lora_adapter", {"lora_name": "nope"}, 400, "no LoRA adapter named 'nope'"),
])
def test_bad_input_is_a_clear_error(http, route, body, status, words):
    r = http.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    if route.endswith("_lora_adapter") and "lora_id" not in words:  # SGLang's clients read these
        assert r.json()["success"] is False and words in r.json()["error_message"]


def test_load_and_unload_under_traffic(http, lora_server, adapters):
    """Requests for the base model and both adapters keep running while adapter c is loaded (into a full pool:
    two slots, three adapters), used, and adapter a unloaded: every request not refused for naming an unloaded
    adapter gets PEFT's output; the scheduler's invariant holds afterwards."""
    root, want = adapters
    stop, failures, done = threading.Event(), [], []

    def traffic(lora):
        with lora_server.client() as c:
            while not stop.is_set():
                r = gen(c, lora)
                if r.status_code == 200:
                    if r.json()["output_ids"] != want[lora]:
                        failures.append((lora, r.json()["output_ids"]))
                    done.append(lora)
                elif not (lora == "a" and "unknown LoRA adapter 'a'" in r.text):
                    failures.append((lora, r.status_code, r.text))

    threads = [threading.Thread(target=traffic, args=(lora,)) for lora in (None, "a", "b")]
    for t in threads:
        t.start()
    try:
        r = http.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "c")})
        assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b", "c"}
        for _ in range(3):
            assert gen(http, "c").json()["output_ids"] == want["c"]
        r = http.post("/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"b", "c"}
        assert "a" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert gen(http, "c").json()["output_ids"] == want["c"]
        r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")})
        assert r.status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures[:3]
    assert {None, "b"} <= set(done)
    info = http.get("/server_info").json()
    assert info["invariant_ok"] is True and info["lora"]["loads_from_disk"] >= 1


class _Recording(rg.RuntimeEndpoint):
    """The HTTP backend, noting the adapter of every request it sends (gens, fork prefills, select's scoring)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.sent: list[str | None] = []

    def generate(self, requests):
        self.sent += [r.lora_name for r in requests]
        return super().generate(requests)


def test_frontend_program_runs_on_an_adapter(lora_server):
    """`run(lora_name=...)`: every request of the program carries the adapter; its gen is what /generate gives
    with that adapter. `lora_path` names a folder, not a run's adapter: refused with the right name."""

    @rg.function
    def prog(s, text):
        s += text
        s += rg.gen("x", max_tokens=NEW, temperature=0, ignore_eos=True)
        s += rg.select("pick", choices=[" yes", " no"])

    with lora_server.client() as c:
        text = c.post("/detokenize", json={"tokens": PROMPT}).json()["text"]
        direct = {lora: c.post("/generate", json={"text": text, "lora_path": lora, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}).json()["text"] for lora in ("b", None)}
    for lora in ("b", None):
        backend = _Recording(lora_server.url)
        state = prog.run(text=text, backend=backend, lora_name=lora)
        assert state["x"] == direct[lora] and state["pick"] in (" yes", " no")
        assert len(backend.sent) >= 3 and set(backend.sent) == {lora}  # the gen and the scoring requests
    assert direct["b"] != direct[None]
    with pytest.raises(Exception, match="unknown LoRA adapter 'zz'"):
        prog.run(text=text, backend=rg.RuntimeEndpoint(lora_server.url), lora_name="zz")
    with pytest.raises(TypeError, match="lora_name"):
        prog.run(text=text, backend=rg.RuntimeEndpoint(lora_server.url), lora_path="b")


def test_router_keys_prefixes_by_adapter():
    assert prompt_text({"text": "hello", "lora_path": "a"}) != prompt_text({"text": "hello", "lora_path": "b"})
    assert prompt_text({"text": "hello"}) == "hello"
    assert prompt_text({"model": "a", "prompt": "hi"}).endswith("hi")
    assert prompt_text({"model": "a", "prompt": "hi"}) != prompt_text({"model": "b", "prompt": "hi"})
    assert prompt_text({"text": ["x", "y"], "lora_path": ["a", None]}).startswith("\x00a,None\x00")
    assert prompt_text({"text": "hello", "lora_name": "a"}) == prompt_text({"text": "hello", "lora_path": "a"})
