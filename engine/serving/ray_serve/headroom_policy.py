"""The headroom router's choice, free of Ray: which replicas can take a prompt now, and the least loaded of them.

Each replica publishes (`record_routing_stats`) what its controller measured: the prompt tokens memory and cap
admit into its next step (`effective_prefill_tokens`), the prompt tokens already queued to prefill, its free KV
blocks and its queue. Those stats are up to a stats period old, so the router adds what it has routed to the
replica since (the `Ledger`). A prompt's shared prefix (a chat's system turns: prompt_size) is likely cached
where that prefix went last (the `Affinity`), so there it costs only its other tokens. A replica can take a
prompt now when the prompt's first step (what it must prefill, or the largest chunk its controller admits) fits
beside what is queued ahead of it, and its free KV holds it. Of those, the one with the fewest prompt tokens
queued, this prompt's included, goes first (then the fewest requests); when none can, the same rule runs over all
healthy replicas, so a request is never refused here (the replica's own admission decides). The fleet simulator
(bench/fleet/, bench/results/fleet.md) chose this over power of two choices, and the prefix homes over none.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from engine.core.stats import EngineStats
from engine.serving.messages import PrefillLoad

K = TypeVar("K", bound=Hashable)

LEDGER_SLACK_S = 0.25  # a routed request counts until stats published this long after it was routed
LEDGER_MAX_AGE_S = 30.0  # and never longer (a replica that stopped publishing)
UNKNOWN_STEP_TOKENS = 2048  # a replica that has not published yet: assumed prompt tokens per step
AFFINITY_PREFIXES = 100_000  # prefixes remembered (least recently routed forgotten first)


def routing_stats(
    snap: EngineStats, num_waiting: int, healthy: bool, load: PrefillLoad | None, now: float
) -> dict[str, Any]:
    """What a replica publishes for `Headroom.of`, taken at `now` (Ray polls it; bench/fleet reads it in virtual
    time). `load` None: the engine is not running, so only its counters."""
    stats: dict[str, Any] = {
        "healthy": healthy,
        "kv_blocks_free": snap.kv_blocks_free,
        "block_size": snap.block_size,
        "num_waiting": num_waiting,
        "num_running": snap.num_running,
        "published_at": now,
    }
    if load is not None:
        stats.update(asdict(load))
    return stats


@dataclass(frozen=True)
class Headroom:
    """One replica's published stats, less what was routed to it since they were taken."""

    step_tokens: int  # prompt tokens its next step admits (effective_prefill_tokens)
    queued_tokens: int  # prompt tokens queued ahead of a new request (published + routed since)
    free_tokens: int  # KV tokens free after the queued prompts take theirs
    queue_len: int  # requests waiting or running
    healthy: bool = True

    @classmethod
    def of(cls, stats: Mapping[str, Any], routed_tokens: int = 0) -> Headroom:
        if "effective_prefill_tokens" not in stats:  # no stats yet: only what this router sent
            return cls(UNKNOWN_STEP_TOKENS, routed_tokens, 1 << 62, 0, bool(stats.get("healthy", True)))
        queued = int(stats["queued_prefill_tokens"]) + routed_tokens
        return cls(
            step_tokens=int(stats["effective_prefill_tokens"]),
            queued_tokens=queued,
            free_tokens=int(stats["kv_blocks_free"]) * int(stats["block_size"]) - queued,
            queue_len=int(stats["num_waiting"]) + int(stats["num_running"]),
            healthy=bool(stats.get("healthy", True)),
        )

    def can_take(self, prompt_tokens: int) -> bool:
        first_step = min(prompt_tokens, self.step_tokens)
        return (
            self.healthy
            and self.step_tokens > 0
            and self.queued_tokens + first_step <= self.step_tokens
            and prompt_tokens <= self.free_tokens
        )


@dataclass(frozen=True)
class Prompt:
    """What the router knows of a request before any replica tokenizes it. `home`: the replica its prefix
    went to last (`Affinity`), where that prefix's KV blocks are likely cached, so `cached_tokens` of it need
    no prefill there."""

    tokens: int
    home: Hashable | None = None
    cached_tokens: int = 0

    def to_prefill(self, replica: Hashable) -> int:
        return self.tokens - self.cached_tokens if replica == self.home else self.tokens


def work_ahead(view: Headroom, prefill: int) -> tuple[bool, int, int]:
    """Prompt tokens queued ahead, with this prompt's own, not steps: the adaptive controller's prefill cap grows
    with the prompts a replica has seen, so dividing by it would pull long prompts to the replica that took the
    last one."""
    return (not view.healthy, view.queued_tokens + prefill, view.queue_len)


def choose_two(views: Mapping[K, Headroom], prompt: Prompt, rng: random.Random, draw: int = 0) -> list[K]:
    """The two replicas with the least work ahead among those that can take the prompt now (among all healthy
    when none can), ties broken at random. The ledger adds a routed prompt to its replica's work at once, so a
    burst within one stats period spreads instead of herding onto one replica. `draw` > 0 first draws that many
    at random (power of d choices, the rule before the fleet simulator compared them: bench/fleet/)."""
    prefill = prompt.to_prefill
    able = [k for k, v in views.items() if v.can_take(prefill(k))]
    pool = able or [k for k, v in views.items() if v.healthy] or list(views)
    if draw:
        pool = rng.sample(pool, min(draw, len(pool)))
    # One key per replica in pool order, so the random tie-breaks are drawn as a key function would draw them;
    # the position breaks exact ties as nsmallest's stability does. (A fleet of 1,000 ranks each request here.)
    keys = [(*work_ahead(views[k], prefill(k)), rng.random(), i) for i, k in enumerate(pool)]
    return [pool[key[-1]] for key in heapq.nsmallest(2, keys)]


def rank(views: Mapping[K, Headroom], prompt: Prompt, rng: random.Random) -> list[K]:
    """Replica keys best first: `choose_two`, then the rest by work ahead (Ray tries them in order if a queue
    is full)."""
    first = choose_two(views, prompt, rng)
    rest = (k for k in views if k not in first)
    return first + sorted(rest, key=lambda k: work_ahead(views[k], prompt.to_prefill(k)))


class Affinity:
    """The replica each prompt prefix went to last (where its blocks were used most recently, so the least likely
    evicted), for the `AFFINITY_PREFIXES` most recently routed prefixes."""

    def __init__(self) -> None:
        self._home: OrderedDict[Hashable, Hashable] = OrderedDict()

    def home(self, prefix: Hashable | None) -> Hashable | None:
        return self._home.get(prefix) if prefix is not None else None

    def prompt(self, tokens: int, prefix: Hashable | None, prefix_tokens: int) -> Prompt:
        """`prefix`: a key of the prompt's first `prefix_tokens` tokens (None: none worth caching)."""
        home = self.home(prefix)
        return Prompt(tokens, home, prefix_tokens if home is not None else 0)

    def routed(self, prefix: Hashable | None, replica: Hashable) -> None:
        if prefix is None:
            return
        self._home[prefix] = replica
        self._home.move_to_end(prefix)
        if len(self._home) > AFFINITY_PREFIXES:
            self._home.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        for prefix in [p for p, r in self._home.items() if r == replica]:
            del self._home[prefix]


class Ledger:
    """Prompt tokens this router sent to each replica, kept until the replica's stats include them."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._sent: defaultdict[Hashable, deque[tuple[float, int]]] = defaultdict(deque)

    def add(self, replica: Hashable, prompt_tokens: int) -> None:
        self._sent[replica].append((self._clock(), prompt_tokens))

    def routed_since(self, replica: Hashable, published_at: float | None) -> int:
        """Tokens routed that stats published at `published_at` may not have seen (all when None)."""
        sent = self._sent.get(replica)
        if not sent:
            return 0
        seen = published_at - LEDGER_SLACK_S if published_at is not None else float("-inf")
        cutoff = max(seen, self._clock() - LEDGER_MAX_AGE_S)
        while sent and sent[0][0] < cutoff:
            sent.popleft()
        return sum(tokens for _, tokens in sent)

    def forget(self, replica: Hashable) -> None:
        self._sent.pop(replica, None)
