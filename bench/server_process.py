"""What the benchmarks that run `headroom serve` as a subprocess share: a free port to give it, and a stop
that lets it drain first."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
