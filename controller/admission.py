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

Liveness: an empty step always admits a minimal chunk or one decode. Otherwise a model that over-predicts
(a fresh plant, a reset) would defer everything, no step would run, and nothing would ever correct it.
"""

from __future__ import annotations

import math

from controller.estimator import predict
from telemetry.record import StepShape

INF = float("inf")


def largest_chunk(r: list[float], shape: StepShape, context: int, chunk: int, limit: float) -> int:
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


def decodes_that_fit(r: list[float], shape: StepShape, contexts: list[int], limit: float) -> int:
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


def is_empty(shape: StepShape) -> bool:
    return shape.prefill_tokens == 0 and shape.decode_seqs == 0
