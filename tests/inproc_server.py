"""An app under uvicorn in a thread of the test process: real sockets (streams and requests overlap, clients
disconnect), while the test can still look at the engine it serves."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Serve `app` on a free loopback port; yields its base URL and stops the server afterwards."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical")
    sock = config.bind_socket()
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not runner.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-thread server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        runner.should_exit = True
        thread.join(30)
