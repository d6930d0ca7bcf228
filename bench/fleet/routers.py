"""The routing rules the fleet simulator compares, each over what its real counterpart can know.

- `default`: Ray Serve's PowerOfTwoChoicesRequestRouter, modelled: two live replicas drawn at random, the one
  with fewer ongoing requests (the router's own count, +1 on send and -1 on completion, as Ray's queue-length
  cache keeps it), skipping a replica at `max_ongoing_requests`; when both are full the request waits at the
  router and tries again (Ray's backoff).
- `round_robin`, `least_outstanding`: the textbook rules over the same counts.
- `prefix_affinity`: a chat goes to the replica its tenant's system prompt went to last, while that replica's
  queue is within `AFFINITY_SLACK` of the shortest (the balance guard of SGLang's cache-aware router and
  Ray's PrefixCacheAffinityRouter); otherwise, and for prompts without a shared prefix, `default`.
- `headroom`: `engine/serving/ray_serve/headroom_policy.py`, the code the Ray deployment runs, over each
  replica's published stats (every `STATS_PERIOD_S`, as the launcher polls), its ledger and the prefix homes:
  the least work ahead among the replicas that can take the prompt now, where a chat's system prompt is not
  work at the replica its tenant went to last (the replica has it cached).
- `headroom_no_prefix`: the same without the prefix homes (the rule before the simulator found them).
- `headroom_p2c`: that, but power of two choices among the replicas that can take the prompt (the rule before
  this simulator: `choose_two(..., draw=2)`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from bench.fleet.load import FleetRequest
from engine.serving.ray_serve.headroom_policy import Affinity, Headroom, Ledger, Prompt, choose_two

AFFINITY_SLACK = 4  # ongoing requests a tenant's replica may have beyond the fleet's shortest queue


class Fleet(Protocol):
    """What the simulator shows a router."""

    ongoing: list[int]  # requests sent to each replica and not finished
    alive: list[bool]
    max_ongoing: int
    system_tokens: int  # a tenant's shared system prompt

    def stats(self, replica: int) -> dict: ...

    def now(self) -> float: ...


class Router:
    """`choose` returns a replica, or None to keep the request at the router until the next completion or
    published stats."""

    name = ""
    reads_stats = False  # whether the replicas' published stats are what it routes by

    def __init__(self, fleet: Fleet, rng: random.Random) -> None:
        self.fleet, self.rng = fleet, rng

    def open(self, i: int) -> bool:
        return self.fleet.alive[i] and self.fleet.ongoing[i] < self.fleet.max_ongoing

    def choose(self, req: FleetRequest) -> int | None:
        raise NotImplementedError

    def routed(self, replica: int, req: FleetRequest) -> None:
        """A request was sent to `replica`."""

    def published(self, replica: int) -> None:
        """`replica` published new stats."""

    def replaced(self, replica: int) -> None:
        """`replica` died (and will come back as a fresh one)."""


class PowerOfTwo(Router):
    name = "default"

    def choose(self, req: FleetRequest) -> int | None:
        n, ongoing = len(self.fleet.alive), self.fleet.ongoing
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1) if n > 1 else 0
        j += j >= i and n > 1
        able = [k for k in (i, j) if self.open(k)]
        return min(able, key=ongoing.__getitem__) if able else None


class RoundRobin(Router):
    name = "round_robin"
    _next = 0

    def choose(self, req: FleetRequest) -> int | None:
        n = len(self.fleet.alive)
        for step in range(n):
            i = (self._next + step) % n
            if self.open(i):
                self._next = i + 1
                return i
        return None


class LeastOutstanding(Router):
    name = "least_outstanding"

    def choose(self, req: FleetRequest) -> int | None:
        ongoing = self.fleet.ongoing
        able = [i for i in range(len(ongoing)) if self.open(i)]
        if not able:
            return None
        least = min(ongoing[i] for i in able)
        return self.rng.choice([i for i in able if ongoing[i] == least])


class PrefixAffinity(PowerOfTwo):
    name = "prefix_affinity"

    def __init__(self, fleet: Fleet, rng: random.Random) -> None:
        super().__init__(fleet, rng)
        self.affinity = Affinity()

    def choose(self, req: FleetRequest) -> int | None:
        home = self.affinity.home(_prefix(req))
        if home is not None and self.open(home):
            shortest = min(q for q, up in zip(self.fleet.ongoing, self.fleet.alive, strict=True) if up)
            if self.fleet.ongoing[home] - shortest <= AFFINITY_SLACK:
                return home
        return super().choose(req)

    def routed(self, replica: int, req: FleetRequest) -> None:
        self.affinity.routed(_prefix(req), replica)

    def replaced(self, replica: int) -> None:
        self.affinity.forget(replica)


class HeadroomRouter(Router):
    """Each replica's `Headroom` view is rebuilt when it publishes or is sent a request; the ledger ages on
    the simulator's clock."""

    name = "headroom"
    reads_stats = True
    draw = 0  # choose_two's: 0 = every replica that can take the prompt
    affine = True  # a chat's system prompt counts as cached at the replica its tenant went to last

    def __init__(self, fleet: Fleet, rng: random.Random) -> None:
        super().__init__(fleet, rng)
        self.ledger = Ledger(clock=fleet.now)
        self.affinity = Affinity()
        self.views = {i: self._view(i) for i in range(len(fleet.alive))}

    def _view(self, i: int) -> Headroom:
        stats = self.fleet.stats(i)
        view = Headroom.of(stats, self.ledger.routed_since(i, stats.get("published_at")))
        return view if self.fleet.alive[i] else Headroom(0, 0, 0, 0, healthy=False)

    def _prompt(self, req: FleetRequest) -> Prompt:
        if not self.affine:
            return Prompt(req.prompt_tokens)
        shared = min(self.fleet.system_tokens, req.prompt_tokens)
        return self.affinity.prompt(req.prompt_tokens, _prefix(req), shared)

    def choose(self, req: FleetRequest) -> int | None:
        for i in choose_two(self.views, self._prompt(req), self.rng, self.draw):
            if self.open(i):
                return i
        return None

    def routed(self, replica: int, req: FleetRequest) -> None:
        self.ledger.add(replica, self._prompt(req).to_prefill(replica))
        self.affinity.routed(_prefix(req), replica)
        self.views[replica] = self._view(replica)

    def published(self, replica: int) -> None:
        self.views[replica] = self._view(replica)

    def replaced(self, replica: int) -> None:
        self.ledger.forget(replica)
        self.affinity.forget(replica)
        self.views[replica] = self._view(replica)


class HeadroomNoPrefix(HeadroomRouter):
    name = "headroom_no_prefix"
    affine = False


class HeadroomPowerOfTwo(HeadroomNoPrefix):
    name = "headroom_p2c"
    draw = 2


def _prefix(req: FleetRequest) -> int | None:
    return req.tenant if req.tenant >= 0 else None


ROUTERS: dict[str, Callable[[Fleet, random.Random], Router]] = {
    r.name: r
    for r in (
        PowerOfTwo, RoundRobin, LeastOutstanding, PrefixAffinity, HeadroomPowerOfTwo, HeadroomNoPrefix, HeadroomRouter
    )
}  # fmt: skip
