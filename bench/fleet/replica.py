"""One replica of the simulated fleet: a twin engine with its own scheduler, adaptive controller and sized KV
pool, on its own virtual clock, which the fleet's event loop moves step by step.

A step is computed when the fleet's clock reaches its start; its outputs belong to its end (`clock()`), and the
fleet shows them to the router only then. Stats are published with the serving replica's own function
(`routing_stats`), read at a step boundary as the Ray replica's engine-thread query is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.fleet.load import FleetRequest
from engine.backends.twin.backend import TwinBackend, as_twin
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingParams
from engine.core.stats import FinishedRequest
from engine.factory import build_engine
from engine.serving.async_engine import QueueFullError, refuse_when_full
from engine.serving.messages import PrefillLoad
from engine.serving.ray_serve.headroom_policy import routing_stats


@dataclass
class Counters:
    """What a replica's past incarnations add to the fleet's totals."""

    ooms: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class Cut:
    """A request on a replica that died, and what its client had of it: tokens, and when the first came."""

    req: FleetRequest
    produced: list[int]
    first_token_at: float | None


@dataclass
class SimReplica:
    cfg: EngineConfig
    max_waiting: int
    engine: LLMEngine = field(init=False)
    twin: TwinBackend = field(init=False)  # the card, for another process that takes memory on it
    inflight: dict[int, FleetRequest] = field(default_factory=dict)
    done: dict[int, FinishedRequest] = field(default_factory=dict)  # finished, not yet shown to the fleet
    stats: dict = field(default_factory=dict)
    up: bool = True
    stepping: bool = False  # a step event is pending
    incarnation: int = 0
    past: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self._start()

    def _start(self) -> None:
        """A fresh process: a new engine and controller that learn from scratch."""
        self.engine = build_engine(self.cfg)
        self.twin = as_twin(self.engine.backend)
        self.engine.finish_listeners.append(self._finished)

    def _finished(self, request: FinishedRequest) -> None:
        self.done[int(request.request_id[1:])] = request

    def clock(self) -> float:
        return self.engine.now()

    def submit(self, req: FleetRequest, now: float, system_tokens: int, produced: list[int]) -> str | None:
        """Queue `req`, resumed after the tokens its client has (`produced`); the reason it is refused (the
        server's 429 or 400), or None."""
        engine = self.engine
        try:
            refuse_when_full(engine.stats().num_waiting, self.max_waiting)
        except QueueFullError:
            return "queue_full"
        engine.advance_to(now)  # an idle device waits for the arrival; a busy one is past it
        params = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True, temperature=0.0)
        try:
            engine.add_request(f"r{req.index}", req.prompt_ids(system_tokens), params, req.arrival, produced)
        except RequestError:
            return "bad_request"
        self.inflight[req.index] = req
        return None

    def step(self) -> list[int] | None:
        """One engine step; the indices of the requests it finished, or None when it could not run one (nothing
        schedulable until another request arrives)."""
        engine, before, t = self.engine, self.engine.step_id, self.clock()
        outputs = engine.step()
        if engine.step_id == before and self.clock() == t:
            return None
        return [int(o.request_id[1:]) for o in outputs if o.finish_reason is not None]

    def finish(self, index: int) -> tuple[FleetRequest, FinishedRequest]:
        return self.inflight.pop(index), self.done.pop(index)

    def publish(self, now: float) -> None:
        snap = self.engine.stats()
        self.stats = routing_stats(snap, snap.num_waiting, snap.healthy, PrefillLoad.of(self.engine), now)

    def die(self, now: float) -> list[Cut]:
        """The replica's process ends: what it held, each request with what its client has of it by `now`."""
        lost = [self._cut(req, now) for req in self.inflight.values()]
        stats = self.engine.stats()
        self.past.ooms += stats.ooms
        self.past.preemptions += stats.preemptions
        self.inflight.clear()
        self.done.clear()
        self.up, self.stepping, self.stats = False, False, {"healthy": False}
        self.incarnation += 1
        return lost

    def _cut(self, req: FleetRequest, now: float) -> Cut:
        """`req` as its stream stands at `now`: the tokens it resumed with, and those of its steps that ended by
        then (a step's tokens reach the client at its end)."""
        seq = self.engine.requests.get(f"r{req.index}") or self.done[req.index]  # running, or its end not yet shown
        resumed = len(seq.output_ids) - len(seq.token_times)
        shown = sum(t <= now for t in seq.token_times)
        first = seq.token_times[0] if shown and not resumed else None
        return Cut(req, list(seq.output_ids[: resumed + shown]), first)

    def restart(self, now: float) -> None:
        self._start()
        self.engine.advance_to(now)
        self.up = True
        self.publish(now)

    def take_memory(self, nbytes: int) -> None:
        """Another process on the card holds `nbytes` (0: gives it back)."""
        self.twin.set_external(nbytes)

    @property
    def ooms(self) -> int:
        return self.past.ooms + (self.engine.stats().ooms if self.up else 0)

    @property
    def preemptions(self) -> int:
        return self.past.preemptions + (self.engine.stats().preemptions if self.up else 0)
