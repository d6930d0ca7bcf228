"""Fault injection: a backend wrapper that fails a random fraction of steps with an OOM, to prove that
recovery requeues work without losing or duplicating a request."""

from __future__ import annotations

import random

import torch

from engine.core.backend import Backend, ForwardingBackend
from engine.core.batch import ModelOutput, SchedulerOutput


class OOMInjector(ForwardingBackend):
    """Everything passes through to the wrapped backend but `execute`, which fails first where the draw says so
    (a decode burst would skip the draw, so none is offered)."""

    def __init__(self, backend: Backend, rate: float, seed: int = 0) -> None:
        if not 0 <= rate < 1:
            raise ValueError(f"OOM injection rate must be in [0, 1), got {rate}")
        super().__init__(backend)
        self._rate = rate
        self._rng = random.Random(seed)
        self.injected = 0

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        if self._rng.random() < self._rate:
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM #{self.injected}")
        return self.inner.execute(batch)
