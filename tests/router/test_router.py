"""The router against two real radixgen servers: results equal direct calls, disconnects abort on the
worker, 4xx pass through unchanged, the router's own routes, API keys."""

from __future__ import annotations

import time

import httpx
import pytest
from router_proc import metric, sse_events, start_router, stop_router
from server_proc import API_KEY

pytestmark = pytest.mark.slow

SHARED = "You are a helpful assistant that answers in one short sentence. " * 4


@pytest.fixture(scope="module")
def router(workers):
    r = start_router([w.url for w in workers])  # no key at the router: the client's goes to the workers
    yield r
    assert stop_router(r) == 0, r.log_tail()


@pytest.fixture(scope="module")
def rhttp(router):
    with router.client(api_key=API_KEY) as c:
        yield c


def _completion(i: int, **kw) -> dict:
    return {"model": "default", "prompt": SHARED + f"Question {i}: name a colour.", "max_tokens": 8,
            "temperature": 0, **kw}


def _chat(i: int, **kw) -> dict:
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": f"Question {i}: name a fruit."}]
    return {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0, **kw}


def _stream_deltas(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    deltas = []
    for e in events[:-1]:
        assert "error" not in e, e
        if "choices" in e:
            c = e["choices"][0]
            deltas.append((c.get("text") or (c.get("delta") or {}).get("content"), c["finish_reason"]))
        else:  # /generate: the cumulative text
            deltas.append((e["text"], e["meta_info"]["finish_reason"]))
    return deltas


def test_non_streamed_results_equal_direct_calls(rhttp, workers):
    direct = workers[0].client()
    for i in range(3):
        a = rhttp.post("/v1/completions", json=_completion(i)).json()
        b = direct.post("/v1/completions", json=_completion(i)).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["choices"][0]["text"]
        assert a["usage"] == b["usage"] | {"prompt_tokens_details": a["usage"].get("prompt_tokens_details")}
        a = rhttp.post("/v1/chat/completions", json=_chat(i)).json()
        b = direct.post("/v1/chat/completions", json=_chat(i)).json()
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        body = {"text": SHARED + f"Question {i}:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        a, b = rhttp.post("/generate", json=body).json(), direct.post("/generate", json=body).json()
        assert a["text"] == b["text"] and a["meta_info"]["completion_tokens"] == 8
    direct.close()


def _streamed_result(deltas: list, cumulative: bool) -> tuple:
    """(the whole text, the last finish reason) of a stream's deltas; /generate's events carry the text so far."""
    if cumulative:
        texts = [t for t, _ in deltas]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), texts  # each extends the last
        return texts[-1], deltas[-1][1]
    return "".join(t or "" for t, _ in deltas), deltas[-1][1]


def test_streamed_results_equal_direct_calls(rhttp, workers):
    """The same text and finish reason through the router as from the worker, in several relayed chunks. (Where
    a stream's chunks fall is not compared: a worker coalesces the tokens a slow reader has not taken yet, so two
    runs of one request may cut their text differently.)"""
    direct = workers[1].client()
    for path, body in (
        ("/v1/completions", _completion(7, stream=True)),
        ("/v1/chat/completions", _chat(7, stream=True)),
        ("/generate", {"text": SHARED + "Q:", "stream": True,
                       "sampling_params": {"max_new_tokens": 6, "temperature": 0}}),
    ):
        via_router = _stream_deltas(rhttp, path, body)
        cumulative = path == "/generate"
        assert _streamed_result(via_router, cumulative) == _streamed_result(_stream_deltas(direct, path, body),
                                                                           cumulative)
        assert len(via_router) >= 3  # several chunks, relayed as they came
    direct.close()


def test_cache_aware_sends_a_shared_prefix_to_one_worker(rhttp, workers):
    prefix = "Reference text for this conversation: " + "the quick brown fox jumps over the lazy dog; " * 30
    before = [w.client().get("/get_server_info").json()["stats"] for w in workers]
    for i in range(4):
        r = rhttp.post("/v1/completions", json={"prompt": prefix + f"Q{i}?", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    after = [w.client().get("/get_server_info").json()["stats"] for w in workers]
    served = [a["num_requests"] - b["num_requests"] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 4], served
    hot = served.index(4)
    cached = after[hot]["cached_tokens"] - before[hot]["cached_tokens"]
    prompt = after[hot]["prompt_tokens"] - before[hot]["prompt_tokens"]
    assert cached / prompt > 0.6, (cached, prompt)  # three of four prompts were mostly in the cache
    text = rhttp.get("/metrics").text
    url = workers[hot].url
    assert metric(text, f'radixgen_router_matched_prefix_chars_total{{worker="{url}"}}') >= 3 * len(prefix)


@pytest.mark.parametrize(
    "path,body,headers",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"}, None),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True, "top_p": 7}, None),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "stop_regex": "("}}, None),
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, {"Authorization": "Bearer wrong"}),
    ],
)
def test_worker_4xx_passes_through_unchanged(router, workers, path, body, headers):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    hdrs = headers or {"Authorization": f"Bearer {API_KEY}"}
    via_router = httpx.post(router.url + path, headers=hdrs, timeout=60, **kw)
    direct = httpx.post(workers[0].url + path, headers=hdrs, timeout=60, **kw)
    assert 400 <= direct.status_code < 500, direct.text
    assert via_router.status_code == direct.status_code
    assert via_router.json() == direct.json()
    assert "error" in via_router.json()


def _wait_worker_idle(worker, timeout: float = 60.0) -> dict:
    with worker.client() as c:
        deadline = time.monotonic() + timeout
        while True:
            info = c.get("/get_server_info").json()
            if info["num_running"] == 0 and info["num_waiting"] == 0 and info["http"]["active_requests"] == 0:
                return info
            assert time.monotonic() < deadline, f"still busy after {timeout}s: {info}"
            time.sleep(0.2)


def _aborts(worker) -> float:
    with worker.client() as c:
        return metric(c.get("/metrics").text, 'radixgen_requests_finished_total{reason="client_abort"}')


def _busy_worker(workers) -> int | None:
    for i, w in enumerate(workers):
        with w.client() as c:
            info = c.get("/get_server_info").json()
        if info["num_running"] + info["num_waiting"] > 0:
            return i
    return None


def test_client_disconnect_aborts_on_the_worker(rhttp, router, workers):
    before = [_aborts(w) for w in workers]
    long = {"prompt": "Count: 1, 2, 3,", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    # streamed: hang up after two events
    with rhttp.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                busy = _busy_worker(workers)
                break
    assert busy is not None  # the request was running on a worker while we read it
    # non-streamed: give up waiting while the worker generates
    with router.client(api_key=API_KEY, timeout=httpx.Timeout(60.0, read=1.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=long)
    for w in workers:
        _wait_worker_idle(w)  # a request left running would need ~3000 decode steps: far past the wait
    assert sum(_aborts(w) for w in workers) - sum(before) >= 2
    for w in _in_flight(rhttp).values():
        assert w == 0


def _in_flight(rhttp) -> dict:
    return {w["url"]: w["in_flight"] for w in rhttp.get("/list_workers").json()["workers"]}


def test_router_routes(rhttp, router, workers):
    assert httpx.get(router.url + "/health").json()["healthy_workers"] == 2  # open: no key
    models = rhttp.get("/v1/models").json()
    assert models["data"][0]["id"] == workers[0].model
    info = rhttp.get("/get_server_info").json()
    assert info["router"]["policy"] == "cache_aware"
    assert sorted(w["url"] for w in info["workers"]) == sorted(w.url for w in workers)
    for w in info["workers"]:
        assert w["healthy"] and w["server_info"]["cache"]["total"] > 0
    assert rhttp.post("/tokenize", json={"text": "hello"}).json()["count"] >= 1
    flushed = rhttp.post("/flush_cache")
    assert flushed.status_code == 200 and len(flushed.json()["workers"]) == 2
    for path, body in (("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
                       ("/unload_lora_adapter", {"lora_name": "x"})):  # to every worker (these serve no LoRA)
        lora = rhttp.post(path, json=body)
        assert lora.status_code == 400 and lora.json()["success"] is False, lora.text
        assert "failed on 2 of 2 workers" in lora.json()["error"]["message"] and "not enabled" in lora.text
    text = rhttp.get("/metrics").text
    for w in workers:
        assert metric(text, f'radixgen_router_worker_healthy{{worker="{w.url}"}}') == 1
    assert "# TYPE radixgen_router_requests_total counter" in text
    aborted = rhttp.post("/abort_request", json={"rid": "no-such-request"})
    assert aborted.status_code == 200 and aborted.json()["aborted"] is False
    missing = rhttp.post("/remove_worker", params={"url": "http://127.0.0.1:1"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "url"
    bad = rhttp.post("/add_worker", params={"url": "ftp://nowhere"})
    assert bad.status_code == 400 and "http://host:port" in bad.json()["error"]["message"]
    dup = rhttp.post("/add_worker", params={"url": workers[0].url})
    assert dup.status_code == 400 and "already" in dup.json()["error"]["message"]
    assert rhttp.get("/no/such/route").status_code == 404


def test_api_key_checked_at_the_router(workers):
    r = start_router([workers[0].url], "--api-key", "router-only-key", api_key=API_KEY)  # either key
    try:
        assert httpx.get(r.url + "/health").status_code == 200
        denied = httpx.post(r.url + "/v1/completions", json=_completion(0))
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(r.url + "/metrics").status_code == 401
        assert httpx.post(r.url + "/add_worker", params={"url": "http://127.0.0.1:9"}).status_code == 401
        with r.client() as ok:  # the router's key, which is also the worker's
            assert ok.post("/v1/completions", json=_completion(0)).status_code == 200
        # a key the router accepts but the worker does not: the worker's 401 comes back
        with r.client(api_key="router-only-key") as other:
            resp = other.post("/v1/completions", json=_completion(0))
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    finally:
        stop_router(r)


def test_no_healthy_worker_is_a_clear_503():
    r = start_router([], wait_healthy=False)
    try:
        health = httpx.get(r.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "no_healthy_worker"
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            resp = httpx.post(r.url + path, json={"prompt": "hi"})
            assert resp.status_code == 503
            error = resp.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "no_healthy_worker"
        dead = httpx.post(r.url + "/add_worker", params={"url": "http://127.0.0.1:9"})  # nothing listens there
        assert dead.status_code == 200 and dead.json()["healthy"] is False
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "hi"}).status_code == 503
    finally:
        stop_router(r)
