"""The SGLang compatibility suite: SGLang's own client code against a real `radixgen serve` subprocess.

SGLang is installed without its server dependencies, in a folder of its own (the Makefile: `pip install
--no-deps --target .venv/extras-sglang sglang`, which tests/conftest.py puts on sys.path); its frontend imports
with the light packages of the `test` extra. Without it, the suite is skipped."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))

from server_proc import start_server, stop_server  # noqa: E402


@pytest.fixture(scope="session")
def sglang_server():
    srv = start_server()
    yield srv
    code = stop_server(srv)
    assert code == 0, f"server exit code {code}:\n{srv.log_tail()}"
