"""A probe that measures nothing: for tests and for backends without device memory.

It is also the easiest base for a computed probe (the twin): subclass and override `measure(shape)`;
`step()` and `sample()` already do the bracketing, including the "also when the step raised" rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from telemetry.record import MemorySample, StepShape


class NullProbe:
    """Reports zeros (plus a fixed capacity and idle baseline, so budgets computed from it stay sane)."""

    name = "null"

    def __init__(self, capacity: int = 0, idle_bytes: int = 0) -> None:
        self.capacity = capacity
        self.idle_bytes = idle_bytes
        self._last = MemorySample(idle_baseline=idle_bytes, peak_allocated=idle_bytes, capacity=capacity)

    def measure(self, shape: StepShape) -> MemorySample:
        """The sample for a step of `shape`. Override in computed probes; called after the step's work."""
        return MemorySample(peak_allocated=self.idle_bytes, idle_baseline=self.idle_bytes, capacity=self.capacity)

    @contextmanager
    def step(self, shape: StepShape) -> Iterator[None]:
        try:
            yield
        finally:
            self._last = self.measure(shape)

    def sample(self) -> MemorySample:
        return self._last

    def add_idle(self, nbytes: int) -> None:
        self.idle_bytes += nbytes
