"""The fleet's offered load: open-loop, seeded arrivals of chat and long-prompt requests, with a shift of mix,
a burst, and tenants whose chats share a system prompt (what prefix-cache affinity routes by).

Why these shapes: chat alone is routed well by any balancer; the routers differ when an 8192-token prompt (a
second of prefill on the card) lands on a replica that also owes short prompts their first token, and when
the mix or the rate moves faster than a stats period. Rates are per replica, so every fleet size sees the same
load per card.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROMPT_VOCAB = 100_000  # filler ids below Llama 3's special tokens, as bench/loadgen.py


@dataclass(frozen=True)
class Scenario:
    duration_s: float = 20.0  # arrivals stop here; the run then drains
    rate_per_replica: float = 2.0  # requests per second per replica, averaged over the run
    long_share: tuple[float, float] = (0.04, 0.12)  # of requests, before and after the shift
    shift_at: float = 0.5  # of the duration: the mix moves from the first long share to the second
    burst: tuple[float, float, float] = (0.3, 3.0, 2.0)  # (start, seconds, rate multiplier)
    long_tokens: int = 8192
    long_output: int = 16
    system_tokens: int = 512  # each tenant's system prompt, shared by its chats
    tenants_per_replica: float = 2.0
    chat_median_tokens: int = 192  # the user part, lognormal
    chat_output_median: int = 64  # lognormal, 8 to 512

    def rate_at(self, t: float) -> float:
        """Arrivals per second per replica at time t; the burst's extra arrivals are paid back by a lower base
        rate, so the run's mean stays `rate_per_replica`."""
        start, length, mult = self.burst
        start *= self.duration_s
        base = self.rate_per_replica * self.duration_s / (self.duration_s + (mult - 1) * length)
        return base * mult if start <= t < start + length else base


@dataclass(frozen=True, slots=True)
class FleetRequest:
    index: int
    arrival: float
    kind: str  # chat | long
    prompt_tokens: int
    output_tokens: int
    tenant: int  # -1: no shared prefix

    def prompt_ids(self, system_tokens: int) -> list[int]:
        """Built when routed (a run holds ~1e5 requests): the tenant's system prompt, then ids unique to it."""
        shared = min(system_tokens, self.prompt_tokens) if self.tenant >= 0 else 0
        return _filler(self.tenant * 104_729, shared) + _filler(7_919 * (self.index + 1), self.prompt_tokens - shared)


def _filler(start: int, n: int) -> list[int]:
    """Ids 1 + (start + j) % PROMPT_VOCAB for j < n, built from ranges (a run routes ~1e5 prompts)."""
    ids: list[int] = []
    first = start % PROMPT_VOCAB
    while n > 0:
        k = min(n, PROMPT_VOCAB - first)
        ids.extend(range(first + 1, first + 1 + k))
        n, first = n - k, 0
    return ids


def _lognormal(rng: random.Random, median: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, 0.6)))))


def generate(scenario: Scenario, replicas: int, seed: int) -> list[FleetRequest]:
    """The run's arrivals, in time order: a Poisson process thinned from the peak rate (exact for a rate that
    steps), each request chat or long by the share in force."""
    s, rng = scenario, random.Random(seed)
    tenants = max(1, round(s.tenants_per_replica * replicas))
    peak = replicas * max(s.rate_at(t) for t in (0.0, s.burst[0] * s.duration_s))
    out: list[FleetRequest] = []
    t = rng.expovariate(peak)
    while t < s.duration_s:
        if rng.random() * peak < replicas * s.rate_at(t):
            share = s.long_share[t >= s.shift_at * s.duration_s]
            n = len(out)
            if rng.random() < share:
                out.append(FleetRequest(n, t, "long", s.long_tokens, s.long_output, -1))
            else:
                tokens = s.system_tokens + _lognormal(rng, s.chat_median_tokens, 8, 2048)
                output = _lognormal(rng, s.chat_output_median, 8, 512)
                out.append(FleetRequest(n, t, "chat", tokens, output, rng.randrange(tenants)))
        t += rng.expovariate(peak)
    return out
