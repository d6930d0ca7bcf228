"""The controller combines a tensor-parallel group's per-rank records by the tightest rank (synthetic records,
no torch): the rank with the least room sets the budget, the largest peak trains the estimator, and the
combination never promises a rank more than it has."""

from __future__ import annotations

import random

import pytest

from controller.adaptive import AdaptivePolicy
from controller.tightest_rank import ranks_state, room_above_idle, step_memory, tightest
from telemetry.record import MemorySample, RankSample, StepRecord, StepShape
from telemetry.units import GIB, MIB


def sample(idle: int, peak: int, capacity: int = 24 * GIB, outside: int = 0, retries: int = 0) -> MemorySample:
    """A CUDA-like sample: `outside` bytes held beyond the allocator (NVML minus reserved)."""
    return MemorySample(
        peak_allocated=idle + peak,
        reserved=idle + peak,
        idle_baseline=idle,
        capacity=capacity,
        device_used=idle + peak + outside,
        alloc_retries=retries,
    )


def record(step: int, ranks: list[MemorySample], shape: StepShape | None = None) -> StepRecord:
    shape = shape or StepShape(prefill_tokens=512, prefill_seqs=1, sum_context=512, max_context=512, sampled_seqs=1)
    per_rank = [RankSample(r, m, 64, 2 * MIB) for r, m in enumerate(ranks)]
    return StepRecord(step, 0.0, 0.01, shape, ranks[0], 10, 54, 64, ranks=per_rank)


def test_the_rank_with_least_room_is_the_base_and_the_largest_peak_counts() -> None:
    # rank 1 has another process's 3 GiB on its card; rank 0 holds the LM head and peaks higher
    r0 = sample(idle=18 * GIB, peak=900 * MIB, retries=1)
    r1 = sample(idle=17 * GIB, peak=600 * MIB, outside=3 * GIB, retries=2)
    combined = tightest([r0, r1])
    assert combined.idle_baseline == r1.idle_baseline
    assert combined.device_used == r1.device_used
    assert combined.step_peak == 900 * MIB
    assert combined.alloc_retries == 3
    state = ranks_state([RankSample(0, r0, 64, MIB), RankSample(1, r1, 64, MIB)])
    assert [s["binding"] for s in state] == [False, True]
    assert state[1]["room_above_idle_bytes"] == 24 * GIB - 3 * GIB - 17 * GIB


def test_the_combination_never_promises_any_rank_more_than_it_has() -> None:
    rng = random.Random(1)
    for _ in range(500):
        ranks = [
            sample(rng.randrange(8 * GIB, 20 * GIB), rng.randrange(0, 2 * GIB), 24 * GIB, rng.randrange(0, 4 * GIB))
            for _ in range(rng.randint(1, 4))
        ]
        combined = tightest(ranks)
        left = room_above_idle(combined) - combined.step_peak
        assert all(room_above_idle(m) - m.step_peak >= left for m in ranks)


def test_one_device_records_are_read_as_they_are() -> None:
    one = StepRecord(1, 0.0, 0.01, StepShape(), sample(GIB, MIB), 1, 1, 2)
    assert step_memory(one) is one.memory
    with pytest.raises(ValueError):
        tightest([])


def budget_after(ranks_of_step: list[list[MemorySample]]) -> dict:
    policy = AdaptivePolicy()
    for step, ranks in enumerate(ranks_of_step, 1):
        policy.observe(record(step, ranks))
    return policy.state()


def test_the_tightest_rank_sets_the_controllers_budget() -> None:
    roomy = sample(idle=16 * GIB, peak=500 * MIB)
    tight = sample(idle=16 * GIB, peak=500 * MIB, outside=4 * GIB)  # another process on rank 1's card
    alone = budget_after([[roomy]] * 20)
    group = budget_after([[roomy, tight]] * 20)
    assert group["budget"]["external"] == 4 * GIB
    assert group["budget"]["usable"] == alone["budget"]["usable"] - 4 * GIB
    assert [r["binding"] for r in group["ranks"]] == [False, True]
    # the estimator learned rank 0's larger peak even though rank 1 sets the budget
    peaky = sample(idle=16 * GIB, peak=900 * MIB)
    mixed = AdaptivePolicy()
    for step in range(1, 21):
        mixed.observe(record(step, [peaky, tight]))
    assert mixed.state()["estimator"]["last_peak_bytes"] == 900 * MIB
