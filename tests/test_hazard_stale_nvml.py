"""A stale NVML reading beside a fresh allocator: NVML is read at most every ~100 ms and held between reads,
while the allocator's stats are exact at every step. After an empty_cache (a pool shrink, an OOM recovery, a
CUDA graph capture) a held reading still counts the bytes just given back; subtracted from this step's
reserved bytes it looks like another process's memory, the pool shrinks for it, and the budget's window
maximum keeps it. The probes pair a held reading with the reserved bytes it was read beside
(MemorySample.device_used_reserved), and the budget subtracts those (controller/budget.py)."""

from __future__ import annotations

import pytest

from bench.cli import run_point
from bench.loadgen import run_closed_loop
from controller.budget import BudgetTracker
from engine.cli import engine_config
from engine.factory import build_engine
from telemetry.probes.cuda import CudaProbe
from telemetry.record import MemorySample
from telemetry.units import GIB, MIB
from tests.test_probes import Clock, FakeCuda

CONTEXT = 400 * MIB  # the CUDA context: the only memory outside the allocator here


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def sample(reserved: int, used: int, read_beside: int | None = None) -> MemorySample:
    return MemorySample(
        peak_allocated=reserved - GIB,
        reserved=reserved,
        idle_baseline=reserved - 2 * GIB,
        capacity=24 * GIB,
        device_used=used,
        device_used_reserved=read_beside,
    )


def test_a_held_reading_after_an_empty_cache_is_not_counted_as_external_memory():
    b = BudgetTracker(0.03, 256)
    b.observe(sample(20 * GIB, 20 * GIB + CONTEXT))  # read now: exact
    b.next_budget(0)
    assert b.external == CONTEXT
    usable = b.budget.usable
    # The pool shrank by 2 GiB and the cache was emptied; NVML still holds the reading from before.
    held = sample(18 * GIB, 20 * GIB + CONTEXT, read_beside=20 * GIB)
    for _ in range(3):
        b.observe(held)
        b.next_budget(0)
    assert b.external == CONTEXT
    assert b.external_at(held) == CONTEXT  # what the pool sizing reads before a step
    assert b.budget.usable >= usable  # the idle floor fell by the 2 GiB: only more room, never less
    # Unpaired, the same reading would have counted the 2 GiB given back as another process's.
    assert BudgetTracker(0.03, 256)._outside_of(sample(18 * GIB, 20 * GIB + CONTEXT)) == 2 * GIB + CONTEXT


def test_memory_another_process_takes_still_shows_at_the_next_read():
    b = BudgetTracker(0.03, 256)
    b.observe(sample(20 * GIB, 20 * GIB + CONTEXT))
    b.observe(sample(20 * GIB, 20 * GIB + CONTEXT, read_beside=20 * GIB))  # held: the other process unseen
    assert b.external == CONTEXT
    b.observe(sample(20 * GIB, 21 * GIB + CONTEXT))  # the next read sees it
    assert b.external == GIB + CONTEXT


def test_the_cuda_probe_reports_the_reserved_bytes_a_held_reading_was_read_beside(fake_cuda: FakeCuda) -> None:
    clock = Clock()
    probe = CudaProbe(0, min_interval=0.1, clock=clock)  # the mem_get_info fallback, rate-limited alike
    clock.t = 0.2
    with probe.step(None):  # type: ignore[arg-type]
        pass
    read = probe.sample()
    assert read.device_used_reserved is None  # read in this step
    fake_cuda.reserved_peak = 1 * GIB  # empty_cache gave a GiB back; NVML is not read again yet
    clock.t = 0.25
    with probe.step(None):  # type: ignore[arg-type]
        pass
    held = probe.sample()
    assert held.device_used == read.device_used and held.device_used_reserved == read.reserved
    b = BudgetTracker(0.03, 256)
    assert b._outside_of(held) == b._outside_of(read)


def realistic_engine():
    return build_engine(engine_config(["--backend", "twin", "--policy", "adaptive", "--twin-sensors", "realistic"]))


def test_realistic_sensors_keep_the_external_estimate_and_the_pool():
    """Graph captures and pool resizes empty the cache between NVML reads: the estimate must stay at the
    context's bytes, and the pool must never shrink below its start-up size for bytes nobody holds."""
    e = realistic_engine()
    start = e.allocator.num_blocks
    outside = e.backend.memory.context + e.backend.memory.external
    seen: list[tuple[int, int]] = []
    e.step_listeners.append(lambda rec, batch: seen.append((e.policy.memory.budget.external, e.allocator.num_blocks)))
    run = run_closed_loop(e, 4, 4, 4096, 4096, fast=False)
    assert len(run.sequences) == 4 and run.ooms == 0
    assert max(x for x, _ in seen) == outside
    assert min(n for _, n in seen) >= start


def test_realistic_sensors_serve_every_request_at_a_kv_bound_point():
    cfg = engine_config(["--backend", "twin", "--policy", "adaptive", "--twin-sensors", "realistic"])
    m = run_point(cfg, (4, 4096, 4096), num_prompts=40)
    assert m["completed"] == 40 and m["failed"] == 0 and m["ooms"] == 0
