"""Another process's memory on the device, three ways: a real second process on the same GPU (CUDA), the twin's
model of one (TwinBackend.set_external), and a simulation for the CPU smoke run.

Each asks for bytes as a real process does: it gets only what the driver has free and asks again until it holds
all it wanted (the second process retries its allocations on its own; the twin's is asked again before every
step, as in bench/external_memory.py). `python -m bench.device_checks.ballast DEVICE` is the second process:
it reads `take BYTES` lines, writes `held BYTES` whenever what it holds changes, and exits at the end of its
input, when its CUDA context and everything it held go back to the driver.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

CHUNK = 1 << 30  # the second process's largest single allocation
MIN_CHUNK = 2 << 20  # the caching allocator rounds large blocks to 2 MiB: nothing smaller is worth halving to
RETRY_S = 0.005  # between a failed smallest allocation and the next try
START_S = 120.0  # the second process's start: python, torch, a CUDA context
EXIT_S = 30.0


class Ballast(Protocol):
    held: int  # bytes held now

    def free_bytes(self) -> int:
        """Bytes the driver could hand out now."""
        ...

    def take(self, nbytes: int) -> None:
        """Ask for `nbytes` in all."""
        ...

    def before_step(self) -> None: ...

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for all that was asked for; True when it is held."""
        ...

    def close(self) -> None:
        """Let go of everything, for good."""
        ...


class ProcessBallast:
    """A second process on the same GPU, holding what it is asked for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.held = self.asked = 0
        self._ready = self._ended = False
        self._changed = threading.Condition()
        command = [sys.executable, "-m", __name__, str(device)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._until(lambda: self._ready, START_S):
            self.close()
            raise RuntimeError(
                f"the second process ({' '.join(command)}) was not ready within {START_S:.0f} s: exit code "
                f"{self.process.returncode} (its error, if any, is on stderr above)"
            )

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.held, self._ready = int(line.split()[1]), True
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until `done` or the process ended; whether `done`."""
        with self._changed:
            self._changed.wait_for(lambda: done() or self._ended, timeout)
            return done()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def take(self, nbytes: int) -> None:
        assert self.process.stdin is not None
        self.asked = nbytes
        self.process.stdin.write(f"take {nbytes}\n")
        self.process.stdin.flush()

    def before_step(self) -> None:
        """Nothing: the process retries on its own."""

    def wait(self, timeout: float) -> bool:
        return self._until(lambda: self.held == self.asked, timeout)

    def close(self) -> None:
        """End the process (its input ends): its CUDA context and all it held go back to the driver."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(EXIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(EXIT_S)  # every line it wrote is read: nothing sets `held` after this
        self.held = 0


class _InProcess:
    """A ballast with no process of its own: what it holds is what it was last asked for, once `_hold` says so."""

    def __init__(self) -> None:
        self.held = self.asked = 0

    def take(self, nbytes: int) -> None:
        self.asked = nbytes
        self.before_step()

    def before_step(self) -> None:
        self.held = self._hold(self.asked)

    def _hold(self, nbytes: int) -> int:
        return nbytes

    def wait(self, timeout: float) -> bool:
        return self.held == self.asked

    def close(self) -> None:
        self.take(0)


class TwinBallast(_InProcess):
    """The twin's other process: it gets what the modelled driver has free (TwinBackend.set_external)."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.backend = backend

    def free_bytes(self) -> int:
        return self.backend.memory.driver_free

    def _hold(self, nbytes: int) -> int:
        return nbytes if self.held == nbytes else self.backend.set_external(nbytes)


class SimulatedBallast(_InProcess):
    """The CPU smoke run's: no other process can take this process's memory on a CPU, so while it holds anything
    every step raises torch.OutOfMemoryError as a GPU's allocator would (it wraps the backend's execute). Its free
    bytes are the CPU probe's capacity above the idle footprint."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.probe = backend.probe
        execute = backend.execute

        def failing(batch: Any) -> Any:
            if self.held:
                raise torch.OutOfMemoryError(f"simulated: another process holds {self.held} bytes")
            return execute(batch)

        backend.execute = failing

    def free_bytes(self) -> int:
        return max(0, self.probe.capacity - self.probe.idle_bytes)


def serve(device: str) -> None:
    """The second process: hold what the last `take` asked for, in chunks, halving a chunk the driver cannot give
    and retrying at the smallest, until its input ends."""
    torch.empty(1, device=device)  # the CUDA context exists before it says it is ready
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put("end")

    threading.Thread(target=read, daemon=True).start()
    chunks: list[torch.Tensor] = []
    held, asked, chunk, reported = 0, 0, CHUNK, None
    while True:
        if held != reported:
            print(f"held {held}", flush=True)
            reported = held
        try:
            words = (lines.get() if held == asked else lines.get_nowait()).split()
        except queue.Empty:
            words = []
        if words[:1] == ["end"]:
            return
        if words[:1] == ["take"]:
            asked = int(words[1])
        while chunks and held > asked:
            held -= chunks.pop().numel()
            torch.cuda.empty_cache()
        if held < asked:
            size = min(chunk, asked - held)
            try:
                chunks.append(torch.empty(size, dtype=torch.uint8, device=device))
                held, chunk = held + size, min(CHUNK, 2 * chunk)
            except torch.OutOfMemoryError:
                if size > MIN_CHUNK:
                    chunk = size // 2
                else:
                    time.sleep(RETRY_S)


if __name__ == "__main__":
    serve(sys.argv[1])
