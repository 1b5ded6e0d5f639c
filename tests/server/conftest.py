"""The session's shared server: one real subprocess for all server tests (the model loads once)."""

from __future__ import annotations

import pytest
from server_proc import start_server, stop_server


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    code = stop_server(srv)  # test_shutdown may have stopped it already: the code is kept
    assert code == 0, f"server exit code {code}:\n{srv.log_tail()}"
