"""The session's shared server: one real subprocess for all server tests (the model loads once)."""

from __future__ import annotations

import pytest
from server_proc import APIS_KEYS, start_server, stop_server


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    code = stop_server(srv)  # test_shutdown may have stopped it already: the code is kept
    assert code == 0, f"server exit code {code}:\n{srv.log_tail()}"


# The Anthropic / Ollama / KServe v2 adapters' server (tests/server/test_*_api.py): the tiny random Qwen3 with a
# template that renders tools and a think block, two API keys (APIS_KEYS), each its own cache namespace.
@pytest.fixture(scope="session")
def apis_server(tmp_path_factory):
    from qwen3_chat import qwen3_chat_model

    model = qwen3_chat_model(tmp_path_factory.mktemp("qwen3-apis"))
    srv = start_server("--model", str(model), "--dtype", "float32", "--api-key", APIS_KEYS[1],
                       "--cache-isolation", "per-key", api_key=APIS_KEYS[0])
    yield srv
    assert stop_server(srv) == 0, srv.log_tail()
