"""Two real worker servers shared by the router tests (the model loads once per worker)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))  # server_proc

from server_proc import start_server, stop_server  # noqa: E402


@pytest.fixture(scope="session")
def workers():
    started = []
    try:
        for _ in range(2):
            # deterministic: the tests compare a request's text through the router with the worker's own, and
            # outside the mode the default model's GGUF kernels round a row by its batch and its cached prefix
            started.append(start_server("--deterministic"))
        yield started
    finally:
        for w in started:
            stop_server(w)
