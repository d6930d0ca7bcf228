"""A server under test as a subprocess: started on a free port, ready once /health answers 200, stopped
with SIGTERM (it drains) and SIGKILL after a timeout. Use `headroom(...)` for `headroom serve`; any other
server (vLLM, say) is a `ServerProcess` with its own argv."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.http import status

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.1
LOG_TAIL_CHARS = 3000


def free_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process in its own process group (a server's workers go down with it). `argv` must make it
    listen on `port`. A context manager: entering starts it and waits for /health."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        port: int,
        *,
        env: dict[str, str] | None = None,
        start_timeout: float = START_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
        preexec_fn: Callable[[], object] | None = None,
    ) -> None:
        self.argv, self.log, self.port, self.env = argv, log, port, env
        self.start_timeout, self.stop_timeout, self.preexec_fn = start_timeout, stop_timeout, preexec_fn
        self.proc: subprocess.Popen | None = None
        self.seconds_to_health = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> str:
        """The command as typed, with `python` for this interpreter."""
        return " ".join(["python", *self.argv[1:]] if self.argv[0] == sys.executable else self.argv)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def start(self) -> float:
        """Start and wait for /health 200; the seconds it took. Raises with the log's tail if the server
        exits or does not answer within the timeout."""
        t0 = time.monotonic()
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=self.preexec_fn,
            )  # fmt: skip
        while status(self.url + "/health", timeout=1.0) != 200:
            exited = self.proc.poll()
            if exited is not None or time.monotonic() - t0 > self.start_timeout:
                why = f"exited with {exited}" if exited is not None else f"no /health 200 in {self.start_timeout:.0f} s"
                self.stop()
                raise RuntimeError(f"the server {why}: {self.command}\n--- log tail ---\n{self.log_tail()}")
            time.sleep(POLL_S)
        self.seconds_to_health = time.monotonic() - t0
        return self.seconds_to_health

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the stop timeout; returns once the whole group is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + self.stop_timeout  # children can outlive the parent for a while
        while _signal_group(self.proc.pid, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(self.proc.pid, signal.SIGKILL)

    def rss_kib(self) -> int:
        """VmRSS of the server process, from /proc/PID/status."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group; False when the group is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def headroom_argv(flags: list[str], port: int, backend: str | None = None) -> list[str]:
    """`headroom serve` as `python -m engine.serving.cli` on 127.0.0.1:`port`."""
    argv = [sys.executable, "-m", "engine.serving.cli", "--host", "127.0.0.1", "--port", str(port)]
    return argv + (["--backend", backend] if backend else []) + flags


def headroom(flags: list[str], log: Path, backend: str | None = None, **kwargs: object) -> ServerProcess:
    """`headroom serve FLAGS` on a free port (not started: use it as a context manager)."""
    port = free_port()
    return ServerProcess(headroom_argv(flags, port, backend), log, port, **kwargs)  # type: ignore[arg-type]
