"""One engine run under a fault schedule, for the fault campaign (bench/fault_campaign.py): the faults, when
they strike, and what is counted.

The faults, each kind a Poisson process in virtual time:
- another process asks for 0 bytes (it lets go) or for up to 4 GiB in all; like bench/external_memory.py's,
  it gets what the driver has free (TwinBackend.set_external) and retries until it holds all it asked for;
- fragmentation: another user of the engine's allocator carves holes and small pins out of one cached
  segment and frees the holes; the pins split the segment and keep a flush from returning it until that
  user's next turn (MemoryModel.fragment);
- injected OOMs: the next step fails with torch.OutOfMemoryError (engine/core/faults.py's injector, armed by
  the schedule instead of failing a random share of steps).
NVML lag is the realistic sensor's read period, set per run (bench/fault_campaign.py).

Why virtual time and not step counts: a realistic and an ideal run of one load take different steps
(different pools, backoffs, recomputes), so the Nth step falls at a different moment of the load in each;
a fault at a virtual time meets both at the same moment. Each kind is drawn from its own seeded generator,
endless, so every run meets the same faults however long it lasts. The faults due are applied before each
call of the engine's step, between two steps, where the engine decides the next one; the other process
retries there too. A slower run lasts longer and so meets more of the schedule: that is part of its cost.

Counted: `lost`, requests that did not finish with all their output tokens, refusals at admission included
(`rejected` says how many of them: each load here is one the engine serves without faults, so a refusal is
the faults' doing); `unrecovered_ooms`, OOMs the engine did not recover from, plus one for a run ended by an
exception or stalled (no step ran for STALL_S virtual seconds); `pool_below_held`, steps after which a
running request's block table named a block past the KV pool.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.twin.backend import TwinBackend, as_twin
from engine.core.backend import Backend
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.faults import OOMInjector
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.outputs import EngineOutput
from engine.core.sequence import Sequence
from engine.core.stats import FinishedRequest
from telemetry.record import StepRecord
from telemetry.units import GIB, MIB

MAX_EXTERNAL = 4 * GIB
# A fragmentation fault: pairs of a hole (freed again) and a pin (kept live), sizes over 1 MiB (the large pool).
FRAGMENT_PAIRS = (1, 4)
FRAGMENT_HOLE = (MIB + 1, 256 * MIB)
FRAGMENT_PIN = (MIB + 1, 8 * MIB)
STALL_S = 60.0  # virtual seconds in which every step failed or scheduled nothing: the engine did not go on


@dataclass(frozen=True)
class Fault:
    t: float  # virtual seconds after the run's start
    kind: str  # "external": the other process wants sizes[0] bytes in all; "fragment": MemoryModel.fragment; "oom"
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rates:
    """Mean virtual seconds between two faults of each kind. A co-tenant whose footprint changes every 10 s
    is already a hostile one; fragmentation is cheap and frequent; an OOM every 10 s is far more than a
    healthy card sees. Fixed in virtual time, not scaled to each load: a co-tenant ignores how long a
    benchmark point is, so the short points meet few faults."""

    external_s: float = 10.0
    fragment_s: float = 2.0
    oom_s: float = 10.0


RATES = Rates()


def _external(rng: random.Random) -> tuple[int, ...]:
    return (0 if rng.random() < 0.5 else rng.randint(1, MAX_EXTERNAL),)


def _fragment(rng: random.Random) -> tuple[int, ...]:
    pairs = rng.randint(*FRAGMENT_PAIRS)
    return tuple(rng.randint(*(FRAGMENT_PIN if i % 2 else FRAGMENT_HOLE)) for i in range(2 * pairs))


def _stream(seed: str, kind: str, gap: float, draw: Callable[[random.Random], tuple[int, ...]]) -> Iterator[Fault]:
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1 / gap)
        yield Fault(t, kind, draw(rng))


def schedule(seed: str, rates: Rates) -> Iterator[Fault]:
    """Every fault of one run in time order, endless (see the module docstring for why)."""
    kinds = (
        ("external", rates.external_s, _external),
        ("fragment", rates.fragment_s, _fragment),
        ("oom", rates.oom_s, lambda _: ()),
    )
    return heapq.merge(*(_stream(f"{seed}/{k}", k, gap, draw) for k, gap, draw in kinds), key=lambda f: f.t)


class ArmedOOMs(OOMInjector):
    """The OOM injector, failing the steps the schedule arms instead of a random share of them, so that both
    runs of a load fail at the same virtual times."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, 0.0)
        self.armed = 0

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        if self.armed:
            self.armed -= 1
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM #{self.injected}")
        return super().execute(batch)


class Stalled(RuntimeError):
    """For STALL_S virtual seconds every step failed or scheduled nothing: the engine did not go on."""


def pool_below_held(engine: LLMEngine, twin: TwinBackend) -> bool:
    """Whether a running request's block table names a block past the KV pool: the allocator's or the
    device's, whichever is smaller (a resize the two disagree on counts too)."""
    pool = min(engine.allocator.num_blocks, twin.memory.num_blocks)
    return max((b for s in engine.scheduler.running for b in s.block_table), default=-1) >= pool


class FaultRun:
    """One twin engine under one fault schedule: the engine's step and add_request wrapped, a step listener
    counting.

    A call that schedules nothing while requests wait is made again, as the serving loop makes it
    (engine/serving/async_engine.py): bench.loadgen would take it for a deadlock and stop, but under the
    adaptive policy the next call may shrink the pool and go on. From the second such call in a row the
    device idles until the next fault, the only thing left that changes in virtual time."""

    def __init__(self, engine: LLMEngine, faults: Iterator[Fault]) -> None:
        self.engine = engine
        self.twin = as_twin(engine.backend)
        self.injector = engine.backend = ArmedOOMs(self.twin)
        self._step, self._add = engine.step, engine.add_request
        engine.step, engine.add_request = self.step, self.add_request  # type: ignore[method-assign]
        self.faults = faults
        self.next = next(faults)
        self.applied: list[Fault] = []
        self.wanted = 0  # bytes the other process asks for
        self.external_max = 0
        self.t0 = self.twin.now()
        self.rejected = 0  # requests refused at admission
        self.below_held = 0
        self.stuck_since: float | None = None  # since when every step failed or scheduled nothing
        self.empty = 0  # calls that scheduled nothing
        self.idle_s = 0.0  # virtual seconds idled waiting for the next fault
        self.pool = (engine.allocator.num_blocks, engine.allocator.num_blocks)  # least, most
        self.finished: list[FinishedRequest] = []
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.finished.append)

    def step(self) -> list[EngineOutput]:
        """The engine's step, made again while it schedules nothing and requests wait (see the class)."""
        e, calls = self.engine, 0
        while True:
            if calls > 1:  # two calls in a row scheduled nothing: idle until the next fault
                self.idle_s += self.t0 + self.next.t - self.twin.now()
                self.twin.advance_to(self.t0 + self.next.t)
            if self.stuck_since is not None and self.twin.now() - self.stuck_since > STALL_S:
                raise Stalled(f"no step ran for {self.twin.now() - self.stuck_since:.1f} s")
            self._apply_due()
            before = e.step_id
            outputs = self._step()
            if e.step_id != before or not e.has_unfinished():
                return outputs
            self.empty += 1
            calls += 1
            self._stuck(True)

    def add_request(self, *args: Any, **kwargs: Any) -> Sequence:
        """The engine's, counting refusals (the load generator counts them as failed requests)."""
        try:
            return self._add(*args, **kwargs)
        except RequestError:
            self.rejected += 1
            raise

    def on_step(self, rec: StepRecord, _batch: SchedulerOutput) -> None:
        self.below_held += pool_below_held(self.engine, self.twin)
        blocks = self.engine.allocator.num_blocks
        self.pool = (min(self.pool[0], blocks), max(self.pool[1], blocks))
        self._stuck(rec.oom)

    def _stuck(self, stuck: bool) -> None:
        if not stuck:
            self.stuck_since = None
        elif self.stuck_since is None:
            self.stuck_since = self.twin.now()

    def _apply_due(self) -> None:
        now = self.twin.now() - self.t0
        while self.next.t <= now:
            fault, self.next = self.next, next(self.faults)
            self.applied.append(fault)
            if fault.kind == "external":
                self.wanted = fault.sizes[0]
            elif fault.kind == "fragment":
                self.twin.memory.fragment(fault.sizes)
            else:
                self.injector.armed += 1
        if self.twin.memory.external != self.wanted:
            self.external_max = max(self.external_max, self.twin.set_external(self.wanted))

    def counters(self, requests: int, error: str | None) -> dict[str, Any]:
        e = self.engine
        done = [s for s in self.finished if s.finish_reason == "length" and len(s.output_ids) == s.max_tokens]
        duration = self.twin.now() - self.t0
        return {
            "completed": len(done),
            "lost": requests - len(done),
            "rejected": self.rejected,
            "ooms": e.ooms,
            "ooms_injected": self.injector.injected,
            "ooms_recovered": e.ooms_recovered,
            "unrecovered_ooms": e.ooms - e.ooms_recovered + (error is not None),
            "pool_below_held": self.below_held,
            "output_throughput": sum(len(s.output_ids) for s in done) / duration if duration > 0 else 0.0,
            "duration_s": duration,
            "steps": e.step_id,
            "preemptions": e.scheduler.num_preemptions,
            "empty_steps": self.empty,
            "idle_s": self.idle_s,
            "pool_blocks": list(self.pool),
            "external_max_gib": self.external_max / GIB,
            "faults": dict(Counter(f.kind for f in self.applied)),
            "error": error,
        }
