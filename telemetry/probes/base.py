"""The memory-probe interface: one per device kind, all reporting a MemorySample per step."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from telemetry.record import MemorySample, StepShape


class MemoryProbe(Protocol):
    name: str

    def step(self, shape: StepShape) -> AbstractContextManager[None]:
        """Bracket the backend's work for one step: reset the peak on entry, read it on exit (also when
        the step raised, e.g. an OOM)."""
        ...

    def sample(self) -> MemorySample:
        """What the last completed (or failed) step measured."""
        ...

    def add_idle(self, nbytes: int) -> None:
        """The bytes the backend holds at rest (weights, the KV pool) changed by `nbytes`, a KV pool resize: a
        probe that computes its idle baseline moves it; one that reads the device's memory ignores it."""
        ...
