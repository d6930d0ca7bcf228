"""An app under uvicorn in a thread of the test process: real sockets (so streams and other requests
overlap as they do in production) with the engine's objects at hand for the test to inspect."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

START_TIMEOUT_S = 30


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """The base URL of `app` served on a free loopback port; stops the server on exit."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical")
    sock = config.bind_socket()
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not runner.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-thread server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        runner.should_exit = True
        thread.join(START_TIMEOUT_S)
