"""The router under hostile clients (issue 46), a real `radixgen router` subprocess with no worker (nothing is
forwarded): a body over --max-request-bytes is a 413 before it is kept or forwarded, by Content-Length and by
counting a chunked upload; deep nesting in a prompt or its images is routed (here: the 503 of no worker), never a
500 of the router's own."""

from __future__ import annotations

import pytest
from router_proc import start_router, stop_router

LIMIT = 4000


@pytest.fixture(scope="module")
def router():
    r = start_router([], "--max-request-bytes", str(LIMIT), wait_healthy=False)
    yield r
    assert stop_router(r) == 0, r.log_tail()


def test_a_body_over_the_limit_is_a_413(router):
    with router.client() as c:
        r = c.post("/generate", json={"text": "x" * LIMIT})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        r = c.post("/v1/chat/completions", content=iter([b'{"messages": "', b"y" * LIMIT, b'"}']))  # chunked
        assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"], r.text
        r = c.post("/generate", json={"text": "small"})
        assert r.status_code == 503, r.text  # under the limit: routed (to no worker)


@pytest.mark.parametrize("body", [
    b'{"text": "x", "image_data": ' + b"[" * 600 + b"]" * 600 + b"}",
    b'{"prompt": ' + b"[" * 600 + b'"a"' + b"]" * 600 + b"}",
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": '
    + b"[" * 600 + b"]" * 600 + b"}}]}]}",
])
def test_deep_nesting_is_routed_not_a_router_error(router, body):
    with router.client() as c:
        path = "/v1/chat/completions" if b"messages" in body else "/generate"
        r = c.post(path, content=body)
        assert r.status_code == 503 and r.json()["error"]["code"] != "internal_error", r.text
