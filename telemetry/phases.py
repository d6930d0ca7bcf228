"""Where an engine step's wall time goes, by phase, so that work outside the forward is seen as it grows.
Phases are timed where they run, on the engine thread: the scheduler and the controller in the engine step,
the forward and the sampler in the backend, detokenizing and streaming in the output processor right after
the step. The lock is for readers on other threads (/metrics, /controller/state).

Phases: schedule (pool sizing and packing the batch), forward (the model, logits included), sampler,
controller (the policy observing the step), telemetry (the step record and its listeners: metrics, trace),
detokenize_stream (stop checks, handing tokens to requests, text and SSE chunks).
"""

from __future__ import annotations

import threading
import time

PHASES = ("schedule", "forward", "sampler", "controller", "telemetry", "detokenize_stream")


class PhaseTimer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(PHASES, 0.0)

    def span(self, phase: str) -> _Span:
        return _Span(self, phase)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    def totals(self) -> dict[str, float]:
        """Seconds spent in each phase since the engine started."""
        with self._lock:
            return dict(self._seconds)


class _Span:
    """The time from entering to leaving, added to a phase (a class, not @contextmanager: an engine step
    opens six, and a generator-based one costs several times more)."""

    __slots__ = ("_timer", "_phase", "_start")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self._timer, self._phase = timer, phase

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._timer.add(self._phase, time.perf_counter() - self._start)
