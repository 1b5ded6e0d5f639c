"""The /v1/responses store on its own: each API key's namespace keeps its own newest STORE_LIMIT responses, so one
key storing many cannot push another key's out (issue 46 item 1: nothing kept per user is shared, its room
included); another key's id is the unknown-id 404."""

from __future__ import annotations

import pytest

from radixgen.common.http_errors import APIError
from radixgen.runtime.server.middleware import KEY_NAMESPACE
from radixgen.runtime.server.openai_responses import STORE_LIMIT, ResponsesServing


def _as(namespace, call):
    token = KEY_NAMESPACE.set(namespace)
    try:
        return call()
    finally:
        KEY_NAMESPACE.reset(token)


def _record(rid: str) -> dict:
    return {"response": {"id": rid, "object": "response"}, "items": []}


def test_each_key_keeps_its_own_newest_responses():
    store = ResponsesServing(api=None)
    _as("key-a", lambda: store.store("resp_a", _record("resp_a")))
    for i in range(STORE_LIMIT + 5):
        _as("key-b", lambda i=i: store.store(f"resp_b{i}", _record(f"resp_b{i}")))
    assert _as("key-a", lambda: store.retrieve("resp_a"))["id"] == "resp_a"  # b's flood left a's alone
    assert _as("key-b", lambda: store.retrieve(f"resp_b{STORE_LIMIT + 4}"))["id"] == f"resp_b{STORE_LIMIT + 4}"
    for namespace, rid in (("key-b", "resp_b0"), ("key-b", "resp_a"), ("key-a", "resp_b9"), (None, "resp_a")):
        with pytest.raises(APIError) as e:  # b's oldest is gone; nobody reads another's
            _as(namespace, lambda rid=rid: store.retrieve(rid))
        assert e.value.status == 404 and e.value.param == "response_id"
    assert _as("key-a", lambda: store.delete("resp_a"))["deleted"] is True
    with pytest.raises(APIError):
        _as("key-a", lambda: store.delete("resp_a"))
