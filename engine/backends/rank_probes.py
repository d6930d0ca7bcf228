"""The probe a tensor-parallel backend hands the engine: every rank measures its own step, and the engine
and the controller see both each rank's sample (the backend's `rank_samples`) and their tightest-rank
combination (controller/tightest_rank.py), which sizes the limits and the KV pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from controller.tightest_rank import tightest
from telemetry.probes.base import MemoryProbe
from telemetry.record import MemorySample, RankSample, StepShape


class RankProbes:
    def __init__(self, probes: list[MemoryProbe], rank_samples: Callable[[], list[RankSample]]) -> None:
        """probes: those this process runs a step under (the torch driver's own; every rank's on the twin, which
        models them all in one process), the driver's first; rank_samples: every rank's latest sample, by rank."""
        self._probes = probes
        self._rank_samples = rank_samples

    @property
    def name(self) -> str:
        """The driver's probe's: every rank runs the same kind."""
        return self._probes[0].name

    @contextmanager
    def step(self, shape: StepShape) -> Iterator[None]:
        with ExitStack() as stack:
            for probe in self._probes:
                stack.enter_context(probe.step(shape))
            yield

    def sample(self) -> MemorySample:
        """The group's sample: the tightest rank's, with the largest step peak of any rank."""
        return tightest([r.memory for r in self._rank_samples()])

    def add_idle(self, nbytes: int) -> None:
        """The driver's probe's: each rank's backend tells its own probe of its own pool."""
        self._probes[0].add_idle(nbytes)
