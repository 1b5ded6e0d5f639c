"""One Engine (the default model) for the language's integration tests, and an HTTP server over it."""

import socket
import threading
import time

import pytest


@pytest.fixture(scope="module")
def engine():
    from radixgen.runtime.engine import Engine

    eng = Engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server_url(engine):
    """The native HTTP API over the same Engine, served from a thread of this process."""
    try:
        import uvicorn

        from radixgen.runtime.server.app import create_app
    except ImportError as e:
        pytest.skip(f"the HTTP server is not available yet: {e}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            pytest.fail("the HTTP server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
