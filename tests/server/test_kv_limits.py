"""A request larger than the KV pool but within the context length (issue 12 item 2) is refused up front with
a 400 naming both sizes, on the native and both OpenAI routes, streamed or not; it never hangs, and the server
then serves with its KV invariant holding. A server with a small pool of its own (the shared one holds 90k)."""

from __future__ import annotations

import pytest
from checks import assert_still_serves
from server_proc import start_server, stop_server

pytestmark = pytest.mark.slow

SLOTS = 1500  # the context length stays the model's 8192


@pytest.fixture(scope="module")
def srv():
    s = start_server("--max-total-tokens", str(SLOTS))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(srv):
    with srv.client() as c:
        yield c


def _kv_error(r) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    msg = err["message"]
    assert "KV cache" in msg and str(SLOTS) in msg, msg
    return msg


LONG = "one two three four five six seven eight nine ten " * 20  # about 200 tokens


@pytest.mark.parametrize("stream", [False, True])
def test_generate_larger_than_the_pool(http, stream):
    body = {"text": LONG, "stream": stream, "sampling_params": {"max_new_tokens": 2000}}
    msg = _kv_error(http.post("/generate", json=body))
    assert "max_new_tokens (2000)" in msg
    # the prompt alone larger than the pool
    _kv_error(http.post("/generate", json={"input_ids": [42] * (SLOTS + 10), "stream": stream,
                                           "sampling_params": {"max_new_tokens": 1}}))
    assert_still_serves(http)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_routes_larger_than_the_pool(http, srv, stream):
    _kv_error(http.post("/v1/completions", json={"model": srv.model, "prompt": LONG, "max_tokens": 2000,
                                                  "stream": stream}))
    _kv_error(http.post("/v1/chat/completions", json={
        "model": srv.model, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2000, "stream": stream}))
    assert_still_serves(http)


def test_within_the_pool_it_runs(http):
    r = http.post("/generate", json={"text": LONG, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 8
    assert_still_serves(http)
