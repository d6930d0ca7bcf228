"""One memory sample from a tensor-parallel group's: the tightest rank sets the limits and the pool size.

Every rank of a group runs the same step over its shard, so one step shape has one peak per rank, and the
step fails on all ranks if it fails on any one. The controller therefore needs, for every rank r,

    predicted peak above idle  <=  capacity_r - outside_r - idle_r - headroom

and it keeps one budget and one estimator. The combined sample makes both hold for every rank at once:

- the base is the rank with the least room above its idle footprint (capacity - outside - idle), whose
  capacity, idle baseline and device readings the budget then reads;
- its step peak is the largest step peak of any rank (the rank that holds the LM head and the logits, say).

Least room and largest peak may come from different ranks, so the combination is conservative: for every
rank, room_r - peak_r >= room_base - largest peak, which is what the budget and the estimator see. The
allocator retries and OOMs add up: a retry on any rank is a retry of the step. A step counts as measured when
any rank measured it (a CPU probe that skips a step reports its shape bucket's last measurement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from telemetry.record import MemorySample, RankSample, StepRecord


def room_above_idle(m: MemorySample) -> int:
    """Bytes the rank could give a step: capacity less its idle footprint and memory held outside its
    allocator (device-wide used less the allocator's reserved bytes of the same moment, where known)."""
    outside = 0
    if m.device_used is not None and m.reserved > 0:
        paired = m.reserved if m.device_used_reserved is None else m.device_used_reserved
        outside = max(0, m.device_used - paired)
    return m.capacity - outside - m.idle_baseline


def tightest_index(samples: Sequence[MemorySample]) -> int:
    """The rank with the least room above idle (the lowest rank on a tie)."""
    return min(range(len(samples)), key=lambda r: (room_above_idle(samples[r]), r))


def tightest(samples: Sequence[MemorySample]) -> MemorySample:
    """The group's sample: the tightest rank's, carrying the largest step peak of any rank."""
    if not samples:
        raise ValueError("no rank samples to combine")
    base = samples[tightest_index(samples)]
    peak = max(m.step_peak for m in samples)
    return dataclasses.replace(
        base,
        peak_allocated=base.idle_baseline + peak,
        alloc_retries=sum(m.alloc_retries for m in samples),
        ooms=sum(m.ooms for m in samples),
        sampled=any(m.sampled for m in samples),
    )


def step_memory(record: StepRecord) -> MemorySample:
    """What the controller learns a step's memory from: its ranks' combination, or the one device's sample."""
    return tightest([r.memory for r in record.ranks]) if record.ranks else record.memory


def ranks_state(ranks: Sequence[RankSample]) -> list[dict]:
    """Each rank's figures for /controller/state, the one the controller's limits are set by marked `binding`."""
    if not ranks:
        return []
    binding = ranks[tightest_index([r.memory for r in ranks])].rank
    return [
        {
            "rank": r.rank,
            "binding": r.rank == binding,
            "room_above_idle_bytes": room_above_idle(r.memory),
            "step_peak_bytes": r.memory.step_peak,
            "idle_bytes": r.memory.idle_baseline,
            "capacity_bytes": r.memory.capacity,
            "device_used_bytes": r.memory.device_used,
            "kv_blocks": r.kv_blocks,
            "kv_bytes": r.kv_bytes,
        }
        for r in ranks
    ]
