"""The adaptive policy's counters: cumulative counts since it started, typed, so a misspelt counter fails where
it is counted rather than appearing as a new key. GET /controller/state shows them all (`counters`, in field
order); metrics export those ControllerStats names (telemetry/controller_stats.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Counters:
    steps: int = 0
    backoffs: int = 0  # the control law's, near misses and OOMs
    deferrals: int = 0  # prefills and decodes memory deferred while packing
    chunks: int = 0  # prefills memory cut into chunks
    preemptions: int = 0  # by the scheduler, for KV blocks
    ooms_recovered: int = 0
    rejected_too_long: int = 0
    estimator_resets: int = 0
    kv_pool_resizes: int = 0
    kv_pool_preemptions: int = 0  # running sequences preempted so the pool could shrink

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
