"""Fault injection: a backend wrapper that fails a random fraction of steps with an OOM, to prove that
recovery requeues work without losing or duplicating a request."""

from __future__ import annotations

import random

import torch

from engine.core.batch import ModelOutput, SchedulerOutput


class OOMInjector:
    def __init__(self, backend: object, rate: float, seed: int = 0) -> None:
        if not 0 <= rate < 1:
            raise ValueError(f"OOM injection rate must be in [0, 1), got {rate}")
        self._backend = backend
        self._rate = rate
        self._rng = random.Random(seed)
        self.injected = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        if self._rng.random() < self._rate:
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM #{self.injected}")
        return self._backend.execute(batch)
