"""Admission and packing: does one more prefill chunk or decode fit beside the step packed so far?

The check is `bound(pred(step + candidate)) <= scale * usable`, where bound() is the estimator's
prediction plus its relative margin (q) and floor (f): pred + q * (pred + f) + f. Solving that for pred
once per step (AdaptivePolicy._refresh) gives a threshold T = scale * usable / (1 + q) - f, so each fit
call here is a handful of multiply-adds (the scheduler asks once per step how many of its decode
candidates fit, and once per prefill chunk). The same functions serve the other two checks (pair,
worst case) with their own summed coefficient vectors and thresholds.

The candidate's features follow engine/core/scheduler.py's StepShape accounting: a prefill chunk c of a
sequence with k tokens already in KV adds c prefill tokens, one prefill sequence, k + c context,
c * (k + c) attention pairs and (conservatively) one sampled row; a decode of context n adds one decode
sequence, n context and one sampled row. The predicted peak is quadratic in c, so the largest chunk is
the root of a quadratic.

`MemoryFit` bundles one step's coefficients and thresholds as the step budget's pure fit functions
(controller/step_budget.py); the liveness rule and the counting of what they cut are the Packer's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import add

from controller.budget import MIB, Budget
from controller.estimator import PeakEstimator, predict
from telemetry.record import StepShape

INF = float("inf")


def largest_chunk(r: Sequence[float], shape: StepShape, context: int, chunk: int, limit: float) -> int:
    """Largest c <= chunk with predict(shape + chunk c at context) <= limit (0 if none)."""
    base = predict(r, shape) + r[2] + r[4] * context + r[6]
    slack = limit - base
    if slack < 0.0:
        return 0
    a = r[5]
    b = r[1] + r[4] + r[5] * context
    if a * chunk * chunk + b * chunk <= slack:
        return chunk
    if a <= 0.0:
        return min(chunk, int(slack / b)) if b > 0.0 else chunk
    c = (-b + math.sqrt(b * b + 4.0 * a * slack)) / (2.0 * a)
    return max(0, min(chunk, int(c)))


def decodes_that_fit(r: Sequence[float], shape: StepShape, contexts: Sequence[int], limit: float) -> int:
    """How many of `contexts`, taken in order, fit as decodes beside `shape`. One check covers the
    usual case where all fit; otherwise the prefix is walked."""
    slack = limit - predict(r, shape)
    per_seq, per_token = r[3] + r[6], r[4]
    if per_seq * len(contexts) + per_token * sum(contexts) <= slack:
        return len(contexts)
    for k, context in enumerate(contexts):
        slack -= per_seq + per_token * context
        if slack < 0.0:
            return k
    return len(contexts)


def thresholds(
    b: Budget, headroom_min: float, scale: float, est: PeakEstimator, retained: PeakEstimator
) -> tuple[float, float, float, float]:
    """(T_prefill, T_decode, T_pair, T_worst), MiB, for the budget `b` scaled by the control law's `scale`.

    Three checks bound a prefill chunk:
    - T_prefill: the step's own peak fits beside what the last step retained (setpoint headroom kept);
    - T_pair: the step's peak plus what it will retain fits as if nothing were retained. This keeps
      chunk sizes even: without it a big chunk (which retains a lot) forces a small one, then a big
      one again, and in a caching allocator the small step's tensors land in the big step's cached
      segment and pin it;
    - T_worst: even so, a caching allocator can hold three segments of the step's biggest tensor at
      its peak (the one being allocated, the previous step's still referenced, and a cached one that a
      small live tensor pins), so peak + 2 x retained must fit the device with the headroom floor
      (`headroom_min`, bytes).
    T_decode bounds a decode-only step as T_prefill does a prefill, with the decode margin."""
    if not b.known:
        return INF, INF, INF, INF
    floor = est.margin_floor
    usable = scale * b.usable_mib
    qp = est.relative_margin(True)
    t_prefill = usable / (1.0 + qp) - floor
    t_decode = usable / (1.0 + est.relative_margin(False)) - floor
    kept = b.retained / MIB
    q = retained.relative_margin(True)
    q = 1.0 + (q if q > qp else qp)
    t_pair = (usable + scale * kept) / q - 2.0 * floor
    worst = b.free_mib + kept - headroom_min / MIB
    return t_prefill, t_decode, t_pair, scale * worst / q - 3.0 * floor


@dataclass(frozen=True)
class MemoryFit:
    """One step's memory checks, frozen when the policy publishes the step's budget: `raw` (the peak
    estimator's coefficients) and `retained` (the retained-memory estimator's), and the thresholds the
    policy's _refresh computed. Three checks bound a prefill chunk (T_prefill, T_pair, T_worst), one the
    decodes (T_decode, or T_prefill beside a prefill)."""

    raw: tuple[float, ...]
    retained: tuple[float, ...]
    t_prefill: float
    t_decode: float
    t_pair: float
    t_worst: float
    min_chunk: int

    @cached_property
    def _pair_worst(self) -> tuple[list[float], list[float]]:
        """Peak + retained and peak + 2 x retained. Only prefill chunk checks read them, so they are summed on
        the first such check: decode-only steps never pay for it."""
        raw, rr = self.raw, self.retained
        return list(map(add, raw, rr)), list(map(add, raw, map(add, rr, rr)))  # r + r == 2.0 * r, exactly

    def largest_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        """The three checks, nothing rounded: the largest chunk memory admits."""
        c = largest_chunk(self.raw, shape, context, chunk, self.t_prefill)
        if c:
            pair, worst = self._pair_worst
            c = largest_chunk(pair, shape, context, c, self.t_pair)
            if c:
                c = largest_chunk(worst, shape, context, c, self.t_worst)
        return c

    def fit_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        """The chunk memory admits, 0 when that is under min_chunk (not worth a step)."""
        c = self.largest_chunk(shape, context, chunk)
        if c >= chunk:
            return chunk
        return c if c >= self.min_chunk else 0

    def fit_decodes(self, shape: StepShape, contexts: Sequence[int]) -> int:
        limit = self.t_decode if shape.prefill_tokens == 0 else self.t_prefill
        return decodes_that_fit(self.raw, shape, contexts, limit)
