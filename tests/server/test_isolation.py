"""A server with several API keys, each its own cache namespace (--cache-isolation per-key), a strict model
name, a small body limit and a short shutdown grace (issue 12 items 4, 10, 11; issue 14 item 4). Its last
test sends SIGTERM with streams running past the grace period: each gets a final error event."""

from __future__ import annotations

import json
import signal
import threading
import uuid

import httpx
import pytest
from checks import assert_still_serves
from server_proc import start_server, stop_server

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-alice-1", "key-bob-2"
LIMIT = 200_000


MANY_KEYS = [f"key-many-{i:02d}-{uuid.uuid4().hex[:8]}" for i in range(12)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# more clients\n" + "\n".join(MANY_KEYS) + "\n")
    s = start_server(
        "--api-key", KEY_B, "--cache-isolation", "per-key", "--strict-model-name",
        "--max-request-bytes", str(LIMIT), "--shutdown-grace-s", "2", "--api-key-file", str(key_file),
        api_key=KEY_A,
    )  # fmt: skip
    yield s
    stop_server(s)


def _client(srv, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_each_key_has_its_own_cache_namespace(srv):
    prompt = f"[{uuid.uuid4().hex}] The shared context of a long system prompt about tides. " * 8
    a, b = _client(srv, KEY_A), _client(srv, KEY_B)

    def cached(c: httpx.Client, path: str = "/v1/completions", **extra) -> int:
        if path == "/generate":
            r = c.post(path, json={"text": prompt, "sampling_params": {"max_new_tokens": 1}, **extra})
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]["cached_tokens"]
        r = c.post(path, json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with a, b:
        assert cached(a) == 0
        assert cached(a) > 40  # a key reuses its own prefixes
        assert cached(b) == 0  # but never another key's: no cross-user probing through cached_tokens
        assert cached(b, "/generate") > 40  # the native API is in the key's namespace too
        assert cached(a, cache_salt="s1") == 0  # a salt partitions a key's namespace further
        assert cached(a, cache_salt="s1") > 40
        assert cached(b, cache_salt="s1") == 0
        assert a.get("/v1/models").status_code == b.get("/v1/models").status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
        assert_still_serves(a)


def test_strict_model_name(srv):
    with _client(srv, KEY_A) as c:
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        r = c.post("/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_small_body_limit(srv):
    with _client(srv, KEY_B) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * LIMIT, "max_tokens": 1})
        assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]
        r = c.post("/generate", content=iter([b'{"text": "', b"y" * LIMIT, b'"}']))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = c.post("/v1/completions", json={"prompt": "x " * (LIMIT // 4), "max_tokens": 1})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        assert_still_serves(c)


def test_radix_tree_view_shows_a_key_only_its_own_namespaces(srv):
    word = "Axolotl" + uuid.uuid4().hex[:6]
    prompt = f"{word} writes down the tides of the bay every morning. " * 5
    a, b = _client(srv, KEY_A), _client(srv, KEY_B)
    with a, b:
        for salt in (None, "s2"):
            r = a.post("/generate", json={"text": prompt, "cache_salt": salt, "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200, r.text
        mine = a.get("/v1/radix_tree", params={"max_nodes": 500}).json()
        assert mine["isolated"] is True
        shown = [n for n in mine["tree"]["nodes"] if n["text"] and word in n["text"]]
        assert len(shown) == 2 and len({n["namespace"] for n in shown}) == 2  # its key's and its salt's, apart
        assert not any("key-" in ns or "s2" in ns for ns in mine["tree"]["namespaces"])  # no salt is shown
        theirs = b.get("/v1/radix_tree", params={"max_nodes": 500}).json()["tree"]
        assert not any(word in (n["text"] or "") for n in theirs["nodes"])
        assert httpx.get(srv.url + "/v1/radix_tree").status_code == 401


def test_stored_responses_are_scoped_to_the_key_that_made_them(srv):
    """Issue 46 item 1: another key reads, continues and deletes a stored response as it would an unknown id
    (the same 404 body, the id aside); the owner still can."""
    a, b = _client(srv, KEY_A), _client(srv, KEY_B)
    body = {"model": srv.model, "input": "Name a colour.", "max_output_tokens": 2}
    with a, b:
        r = a.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert a.get(f"/v1/responses/{rid}").json()["id"] == rid

        def refusal(c: httpx.Client, method: str, path: str, **kw) -> tuple[int, dict]:
            resp = c.request(method, path, **kw)
            return resp.status_code, resp.json()

        unknown = "resp_" + "0" * len(rid[5:])
        for method, path, kw in (("GET", "/v1/responses/{}", {}), ("DELETE", "/v1/responses/{}", {}),
                                 ("POST", "/v1/responses", {"json": {**body, "previous_response_id": "{}"}})):
            def fill(x, i):
                return json.loads(json.dumps(x).replace("{}", i)) if not isinstance(x, str) else x.format(i)
            theirs = refusal(b, method, fill(path, rid), **{k: fill(v, rid) for k, v in kw.items()})
            never = refusal(b, method, fill(path, unknown), **{k: fill(v, unknown) for k, v in kw.items()})
            assert theirs[0] == never[0] == 404, (method, path, theirs)
            assert json.dumps(theirs[1]).replace(rid, unknown) == json.dumps(never[1])
        r = a.post("/v1/responses", json={**body, "previous_response_id": rid})  # the owner continues it
        assert r.status_code == 200, r.text
        with a.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:  # stored at the stream's end
            done = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")][-1]
        streamed = done["response"]["id"]
        assert a.get(f"/v1/responses/{streamed}").status_code == 200
        assert b.get(f"/v1/responses/{streamed}").status_code == 404
        assert a.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
        assert a.get(f"/v1/responses/{rid}").status_code == 404
        assert_still_serves(b)


def test_a_key_cannot_abort_another_keys_requests(srv):
    rid = "mine-" + uuid.uuid4().hex
    a, b = _client(srv, KEY_A), _client(srv, KEY_B)
    body = {"text": "1, 2,", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    with a, b, a.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert b.post("/abort_request", json={"rid": rid}).json()["aborted"] is False
        assert b.post("/abort_request", json={"abort_all": True}).json()["aborted"] is False
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length", events[-1]


def test_many_keys_at_once_each_see_only_their_own(srv):
    """12 keys at once (from --api-key-file), each in a thread: every key's first request of a prompt all of them
    send is computed (nothing of another key's is reused, even while they run side by side), and each key reads
    its own stored response and gets the unknown-id 404 for every other key's."""
    prompt = f"[{uuid.uuid4().hex}] A prompt every client sends at the same moment, about the moon. " * 2
    out: dict[str, tuple[int, str]] = {}

    def client(key: str) -> None:
        with _client(srv, key) as c:
            first = c.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": 1})
            stored = c.post("/v1/responses", json={"model": srv.model, "input": prompt, "max_output_tokens": 1})
            assert first.status_code == stored.status_code == 200, (first.text, stored.text)
            out[key] = (first.json()["usage"]["prompt_tokens_details"]["cached_tokens"], stored.json()["id"])

    threads = [threading.Thread(target=client, args=(k,)) for k in MANY_KEYS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(out) == sorted(MANY_KEYS)
    assert all(first == 0 for first, _ in out.values()), out
    for i, key in enumerate(MANY_KEYS[:4]):
        with _client(srv, key) as c:
            assert c.get(f"/v1/responses/{out[key][1]}").status_code == 200
            for other in MANY_KEYS[:i] + MANY_KEYS[i + 1:]:
                r = c.get(f"/v1/responses/{out[other][1]}")
                assert r.status_code == 404 and r.json()["error"]["param"] == "response_id", r.text


def test_sigterm_past_the_grace_period_ends_streams_with_an_error_event(srv):
    """Last: ends this module's server. Streams still running 2 s after SIGTERM get `data: {"error": ...}`
    then `data: [DONE]` (/v1 and /generate alike), and the server exits 0."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    bodies = {
        "/v1/chat/completions": {
            "model": srv.model,
            "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        },
        "/generate": {"text": "1, 2,", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}, "stream": True},
    }
    events: dict[str, list[str]] = {path: [] for path in bodies}
    started = {path: threading.Event() for path in bodies}

    def consume(path: str) -> None:
        with httpx.stream("POST", srv.url + path, json=bodies[path], headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[path].append(line[6:])
                    started[path].set()
        started[path].set()

    threads = [threading.Thread(target=consume, args=(p,)) for p in bodies]
    for t in threads:
        t.start()
    for e in started.values():
        assert e.wait(120)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert srv.proc.wait(60) == 0, srv.log_tail()
    for path, evs in events.items():
        assert evs[-1] == "[DONE]", (path, evs[-3:])
        err = json.loads(evs[-2])["error"]
        assert err["code"] == "server_shutting_down" and "shutting down" in err["message"], err
        assert len(evs) > 3  # tokens were streamed before the cut
