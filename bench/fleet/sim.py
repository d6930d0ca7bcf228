"""N twin replicas and one router on one event clock, in virtual time: the same seed gives the same run.

Events are taken in time order; at one instant, completions first (they free the router's counts), then
published stats, then faults, then arrivals, then step starts (a step packs every request that arrived by
its start). A replica's step is computed when the clock reaches its start, but its finishes and its stats
become visible only at its end, so no router sees the future. A request a router holds (none can take it)
is offered again, oldest first, at the next completion, stats or restart.
"""

from __future__ import annotations

import gc
import heapq
import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench.fleet.load import FleetRequest, Scenario
from bench.fleet.replica import Cut, SimReplica
from bench.fleet.routers import ROUTERS
from engine.config import EngineConfig
from engine.serving.ray_serve.resend import MAX_RESENDS, Attempts
from telemetry.units import GIB as GiB

STATS_PERIOD_S = 0.5  # engine/serving/ray_serve/launcher.py polls each replica's stats this often
MAX_ONGOING = 512  # the launcher's max_ongoing_requests: 2 x max_waiting
MAX_WAITING = 256  # ServerConfig.max_waiting: a replica's own 429
DRAIN_LIMIT_S = 300.0  # after the last arrival; what is still unfinished then counts as failed
FINISH, PUBLISH, FAULT, ARRIVE, STEP = range(5)  # the order of events at one instant
DIES, RESTARTS = -1, -2  # a FAULT event's arg; one >= 0 is the bytes another process holds on the card


@dataclass(frozen=True)
class Faults:
    """Fractions of the run's duration and of the fleet; each hits replicas drawn from the run's seed."""

    kill_at: float = 0.55
    kill_share: float = 0.05  # at least one replica
    restart_after_s: float = 10.0
    squeeze_at: float = 0.7
    squeeze_share: float = 0.05
    squeeze_gib: float = 6.0  # another process takes this much of the card
    squeeze_for_s: float = 8.0


@dataclass
class Finished:
    kind: str
    ttft: float  # from its arrival to the first token its client got, on whichever replica
    output_tokens: int
    done_at: float
    resent: bool  # a replica it was on died


@dataclass
class Resends:
    """What the ingress's re-sends (engine/serving/ray_serve/resend.py) did in a run."""

    resent: int = 0  # sent again from the start: nothing had reached the client
    resumed: int = 0  # streams that went on elsewhere
    prefill_tokens: int = 0  # prompt and resumed tokens the next replicas prefilled again


@dataclass
class RunOutcome:
    finished: list[Finished] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    ooms: int = 0
    preemptions: int = 0
    duration: float = 0.0
    resends: Resends = field(default_factory=Resends)

    def fail(self, reason: str, n: int = 1) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + n


class FleetSim:
    def __init__(
        self,
        cfg: EngineConfig,
        replicas: int,
        router: str,
        scenario: Scenario,
        faults: Faults | None,
        seed: int,
        max_resends: int = MAX_RESENDS,
    ) -> None:
        self.scenario, self.faults, self.max_resends = scenario, faults, max_resends
        self.attempts: dict[int, Attempts] = {}  # by request index: those a replica died under
        self.first_token_at: dict[int, float] = {}  # the first token a resumed request's client got
        self.reps = [SimReplica(cfg, MAX_WAITING) for _ in range(replicas)]
        self.ongoing = [0] * replicas
        self.alive = [True] * replicas
        self.max_ongoing = MAX_ONGOING
        self.system_tokens = scenario.system_tokens
        self.inflight = 0  # requests on replicas, fleet-wide
        self._now = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []  # (t, kind, tie-break, replica, arg)
        self._seq = 0
        self.held: deque[FleetRequest] = deque()
        self.out = RunOutcome()
        self.rng = random.Random(seed)
        for rep in self.reps:
            rep.publish(0.0)
        self.router = ROUTERS[router](self, random.Random(seed + 1))
        if self.router.reads_stats:
            for i, rep in enumerate(self.reps):
                self._push(STATS_PERIOD_S, PUBLISH, i, rep.incarnation)

    # -- what routers read -------------------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def stats(self, replica: int) -> dict:
        return self.reps[replica].stats

    # -- the loop ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, replica: int, arg: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, replica, arg))

    def run(self, requests: list[FleetRequest]) -> RunOutcome:
        with _rare_collections():
            return self._run(requests)

    def _run(self, requests: list[FleetRequest]) -> RunOutcome:
        self._plan_faults()
        for req in requests:
            self._push(req.arrival, ARRIVE, -1, req.index)
        by_index = {r.index: r for r in requests}
        handlers = {FINISH: self._finish, PUBLISH: self._publish, FAULT: self._fault, STEP: self._step}
        end = self.scenario.duration_s + DRAIN_LIMIT_S
        while self._events and (by_index or self.held or self.inflight):  # stats ticks alone: the run is over
            t, kind, _, replica, arg = heapq.heappop(self._events)
            if t > end:
                break
            self._now = t
            if kind == ARRIVE:
                self.held.append(by_index.pop(arg))
                self._route_held()
            else:
                handlers[kind](replica, arg)
        self.out.fail("never_routed", len(self.held))
        for rep in self.reps:
            self.out.fail("unfinished", len(rep.inflight))
            self.out.ooms += rep.ooms
            self.out.preemptions += rep.preemptions
        self.out.duration = self._now
        return self.out

    def _route_held(self) -> None:
        """Oldest first, as Ray's FIFO routing; stops at the first request no replica takes."""
        while self.held:
            req = self.held[0]
            i = self.router.choose(req)
            if i is None:
                return
            self.held.popleft()
            rep = self.reps[i]
            attempts = self.attempts.get(req.index)
            refused = rep.submit(req, self._now, self.scenario.system_tokens, attempts.token_ids if attempts else [])
            if refused:
                self.out.fail(refused)
                continue
            self.ongoing[i] += 1
            self.inflight += 1
            self.router.routed(i, req)
            if not rep.stepping:
                rep.stepping = True
                self._push(rep.clock(), STEP, i, rep.incarnation)

    def _step(self, i: int, incarnation: int) -> None:
        rep = self.reps[i]
        if incarnation != rep.incarnation:
            return
        done = rep.step()
        if not rep.engine.healthy:  # an unrecovered OOM: the replica fails its health check and is replaced
            self._kill(i)
            return
        end = rep.clock()
        for index in done or ():
            self._push(end, FINISH, i, index)
        rep.stepping = done is not None and rep.engine.has_unfinished()
        if rep.stepping:
            self._push(end, STEP, i, incarnation)

    def _finish(self, i: int, index: int) -> None:
        rep = self.reps[i]
        if index not in rep.inflight:  # lost with an earlier incarnation
            return
        req, done = rep.finish(index)
        self.ongoing[i] -= 1
        self.inflight -= 1
        first = self.first_token_at.get(index, done.token_times[0])
        resent = index in self.attempts
        self.out.finished.append(Finished(req.kind, first - req.arrival, len(done.output_ids), self._now, resent))
        self._route_held()

    def _publish(self, i: int, incarnation: int) -> None:
        """Ray polls every period; a busy replica answers at the end of the step in flight."""
        rep = self.reps[i]
        if incarnation != rep.incarnation:
            return
        if rep.clock() > self._now:
            self._push(rep.clock(), PUBLISH, i, incarnation)
            return
        rep.publish(self._now)
        self.router.published(i)
        self._push(self._now + STATS_PERIOD_S, PUBLISH, i, incarnation)
        self._route_held()

    # -- faults ------------------------------------------------------------------------------------
    def _plan_faults(self) -> None:
        f, n, d = self.faults, len(self.reps), self.scenario.duration_s
        if f is None:
            return
        for i in self.rng.sample(range(n), max(1, round(f.kill_share * n))):
            self._push(f.kill_at * d, FAULT, i, DIES)
        for i in self.rng.sample(range(n), max(1, round(f.squeeze_share * n))):
            self._push(f.squeeze_at * d, FAULT, i, int(f.squeeze_gib * GiB))
            self._push(f.squeeze_at * d + f.squeeze_for_s, FAULT, i, 0)

    def _fault(self, i: int, arg: int) -> None:
        """arg DIES, RESTARTS, or the bytes another process now holds on the replica's card."""
        rep = self.reps[i]
        if arg == DIES and rep.up:
            self._kill(i)
        elif arg == RESTARTS:
            rep.restart(self._now)
            self.alive[i] = True
            self.router.replaced(i)
            if self.router.reads_stats:
                self._push(self._now + STATS_PERIOD_S, PUBLISH, i, rep.incarnation)
            self._route_held()
        elif arg >= 0 and rep.up:
            rep.take_memory(arg)

    def _kill(self, i: int) -> None:
        rep = self.reps[i]
        cuts = rep.die(self._now)
        self.inflight -= self.ongoing[i]
        self.alive[i], self.ongoing[i] = False, 0
        self.router.replaced(i)
        restart = self.faults.restart_after_s if self.faults else 10.0
        self._push(self._now + restart, FAULT, i, RESTARTS)
        if sum(self._resend(cut) for cut in cuts):
            self._route_held()

    def _resend(self, cut: Cut) -> bool:
        """As the ingress does: the request again, through the router, resumed after what its client has; lost
        past the bound (False)."""
        attempts = self.attempts.setdefault(cut.req.index, Attempts(self.max_resends))
        attempts.token_ids = cut.produced
        if cut.first_token_at is not None:
            self.first_token_at[cut.req.index] = cut.first_token_at
        if not attempts.resend():
            self.out.fail("replica_died")
            return False
        if attempts.resumes:
            self.out.resends.resumed += 1
        else:
            self.out.resends.resent += 1
        self.out.resends.prefill_tokens += cut.req.prompt_tokens + len(cut.produced)
        self.held.append(cut.req)
        return True


@contextmanager
def _rare_collections() -> Iterator[None]:
    """A run makes ~1e8 short-lived objects beside the fleet's long-lived ones, so at the default threshold (700
    allocations) the cycle collector runs thousands of times in a large run, some of them over the whole heap, and
    little of what a step makes is cyclic: rarer collections cost memory for a while, never a different result."""
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)
