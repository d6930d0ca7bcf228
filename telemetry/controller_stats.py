"""What a policy publishes for metrics: `Policy.stats()`, read by telemetry/metrics.py. Typed, so a renamed
field breaks loudly here instead of silently dropping a series; `/controller/state` stays the policy's rich
JSON (`Policy.state()`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ControllerStats:
    # Cumulative counts since the policy started (metrics export their deltas).
    backoffs: int = 0
    deferrals: int = 0
    chunks: int = 0  # prefills split into chunks
    ooms_recovered: int = 0
    rejected_too_long: int = 0
    kv_pool_resizes: int = 0
    # Gauges; None where the policy has no such quantity (static policies have none of them).
    budget_bytes: int | None = None  # the memory budget in force, after the control law's scale
    predicted_peak_bytes: int | None = None  # the estimator's last step-peak prediction
    margin_bytes: int | None = None  # the estimator's margin floor
    emergency: bool | None = None
    kv_pool_bytes: int | None = None  # only while the policy sizes the KV pool
    effective_prefill_tokens: int | None = None  # prompt tokens the next step admits: what a fleet routes by
