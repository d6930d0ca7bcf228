"""The twin's realistic sensors (engine/backends/twin/sensors.py): NVML device-wide and read at the probe's
period, CUDA graph pools and cuBLAS workspaces held from start-up; and the ideal sensors unchanged."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from bench.loadgen import run_closed_loop
from engine.backends.twin.allocator import segment_size
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.profile import load_profile
from engine.baselines.seed import SeedStaticPolicy
from engine.config import ConfigError, EngineConfig
from engine.core.llm_engine import LLMEngine
from telemetry.units import MIB

SENSORS = load_profile().section("sensors")
PERIOD = SENSORS["nvml_period_s"]


class Seen(NamedTuple):
    """One step as the controller saw it, beside what the device held at the step's end."""

    end: float
    reported: int  # device_used in the step's sample
    true: int  # NVML's used bytes at the step's end
    reserved: int  # the allocator's reserved peak in the sample


def run(sensors: str, con: int, inp: int, out: int, n: int, on_step=None) -> tuple[TwinBackend, list[Seen]]:
    """A seed-static run step by step (no fast path), recording every step; `on_step(backend, seen)` runs
    after each one, between steps."""
    backend = TwinBackend(num_blocks=64, sensors=sensors)
    engine = LLMEngine(backend, SeedStaticPolicy())
    seen: list[Seen] = []

    def listen(record, batch) -> None:
        m = record.memory
        seen.append(Seen(record.time + record.duration, m.device_used, backend.memory.device_used(), m.reserved))
        if on_step is not None:
            on_step(backend, seen)

    engine.step_listeners.append(listen)
    run_closed_loop(engine, con, n, inp, out, fast=False)
    return backend, seen


def test_nvml_after_an_empty_cache_still_shows_the_freed_bytes_until_the_next_period():
    def flush_after_the_prefill(backend: TwinBackend, seen: list[Seen]) -> None:
        if len(seen) == 1:
            backend.memory.empty_cache()  # torch.cuda.empty_cache(), as a pool shrink does

    _, seen = run("realistic", 1, 256, 32, 1, flush_after_the_prefill)
    prefill, first_decode = seen[0], seen[1]
    assert prefill.reported == prefill.true  # the probe's first read goes to the driver
    # The flush gave the prefill's 42 MiB workspace segment back to the driver, but less than a period has
    # passed, so NVML still reports the prefill's reading.
    assert first_decode.end - prefill.end < PERIOD
    assert first_decode.reported == prefill.reported > first_decode.true
    # What the controller takes for memory outside its allocator grows by the bytes the flush gave back.
    assert first_decode.reported - first_decode.reserved > prefill.reported - prefill.reserved
    later = next(s for s in seen if s.end - prefill.end >= PERIOD)
    assert later.reported == later.true and later.reported < prefill.reported


def test_nvml_is_read_at_most_every_period_and_held_between():
    backend, seen = run("realistic", 4, 256, 64, 6)
    read_at, held = None, None
    for s in seen:
        if read_at is None or s.end - read_at >= PERIOD:
            read_at, held = s.end, s.true
        assert s.reported == held
    assert backend.nvml.reads < len(seen) / 3  # ~18 ms steps: one read in about six


def test_nvml_is_device_wide_another_process_appears_at_the_next_read():
    other = 1 << 30
    state = {}

    def take(backend: TwinBackend, seen: list[Seen]) -> None:
        if len(seen) == 3:
            before = backend.probe.sample().device_used
            assert backend.set_external(other) == other
            state["between"] = backend.probe.sample().device_used - before  # no read between steps
            state["at"] = len(seen)

    backend, seen = run("realistic", 1, 256, 64, 1, take)
    assert state["between"] == 0
    after = [s for s in seen[state["at"] :] if s.reported == s.true]
    assert after and after[0].reported - seen[state["at"] - 1].true >= other - 64 * MIB
    m = backend.memory
    assert m.device_used() == m.context + m.persistent + m.reserved + m.graph_bytes + other


def test_ideal_sensors_see_another_process_at_once():
    backend = TwinBackend(num_blocks=64, sensors="ideal")
    before = backend.probe.sample().device_used
    backend.set_external(1 << 30)
    assert backend.probe.sample().device_used == before + (1 << 30)


def graph_pool_and_workspaces() -> int:
    """Every bucket captured into one pool: the largest working set's segment, every graph's output, and a
    cuBLAS workspace for each of the compute, warm-up and capture streams."""
    buckets = SENSORS["graph_buckets"]
    outputs = sum(-(-b * SENSORS["graph_output_row_bytes"] // 512) * 512 for b in buckets)
    workspaces = 3 * SENSORS["cublas_workspace_bytes"]
    return segment_size(max(buckets) * SENSORS["graph_work_row_bytes"]) + outputs + workspaces


def test_graph_pools_are_held_from_start_up_and_count_in_device_used():
    backend = TwinBackend(num_blocks=64, sensors="realistic")
    m = backend.memory
    assert m.graph_bytes == backend.graphs.reserved == graph_pool_and_workspaces()
    first = backend.probe.sample()  # before any step: the controller's profile sees them
    assert first.device_used == m.context + m.persistent + m.graph_bytes
    backend, seen = run("realistic", 3, 32, 64, 3)
    assert backend.memory.graph_bytes == graph_pool_and_workspaces()  # no step took more
    assert all(s.reserved >= backend.memory.persistent + backend.memory.graph_bytes for s in seen)


def test_a_kv_resize_keeps_the_graphs_and_charges_no_capture():
    """The pool is resized in place (engine/core/kv/vmm.py): the graphs keep their addresses, so no bucket is
    captured again and a resize costs the same under both sensors."""
    costs = []
    for sensors in ("ideal", "realistic"):
        backend = TwinBackend(num_blocks=64, sensors=sensors)
        engine = LLMEngine(backend, SeedStaticPolicy())
        run_closed_loop(engine, 3, 3, 32, 64, fast=False)
        t0 = backend.now()
        plan = engine.resize_kv_pool(48)
        costs.append(backend.now() - t0)
        assert costs[-1] == pytest.approx(backend.resize_cost(plan))
    assert costs[0] == costs[1]
    assert backend.memory.graph_bytes == graph_pool_and_workspaces()


def test_graph_buckets_are_the_torch_backends():
    from engine.model.cuda_graphs import CAPTURE_SIZES

    assert tuple(SENSORS["graph_buckets"]) == CAPTURE_SIZES


def fingerprint(sensors: str | None) -> tuple:
    """None: the backend's default sensors."""
    backend = TwinBackend(num_blocks=64) if sensors is None else TwinBackend(num_blocks=64, sensors=sensors)
    engine = LLMEngine(backend, SeedStaticPolicy())
    mem = []
    engine.step_listeners.append(lambda record, batch: mem.append(record.memory))
    r = run_closed_loop(engine, 4, 16, 256, 64, fast=False)
    return (
        r.steps,
        r.duration,
        r.ooms,
        sum(m.device_used for m in mem),
        max(m.reserved for m in mem),
        max(m.peak_allocated for m in mem),
        sum(m.idle_baseline for m in mem),
    )


# The same run before the sensors existed: every step's probe sample summed (bytes) and the virtual time.
IDEAL = (256, 5.1591462345200005, 0, 5973494202368, 22914531328, 22897664000, 5683520172032)


def test_ideal_is_unchanged():
    assert fingerprint("ideal") == IDEAL


def test_the_backend_defaults_to_realistic_sensors_like_every_command():
    """issue #41: TwinBackend() with no arguments has the sensors EngineConfig and every command default to."""
    backend = TwinBackend()
    assert backend.graphs is not None and backend.nvml.period == PERIOD
    assert backend.memory.graph_bytes == graph_pool_and_workspaces()
    assert fingerprint(None) == fingerprint("realistic") != IDEAL


def test_realistic_is_deterministic_and_moves_memory_not_time():
    a, b = fingerprint("realistic"), fingerprint("realistic")
    assert a == b
    assert a[:3] == IDEAL[:3] and a[3:] != IDEAL[3:]


def test_the_fast_path_is_exact_under_realistic_sensors():
    times = []
    for fast in (True, False):
        engine = LLMEngine(TwinBackend(num_blocks=64, sensors="realistic"), SeedStaticPolicy())
        r = run_closed_loop(engine, 4, 16, 256, 64, fast=fast)
        times.append([s.token_times for s in r.sequences])
    assert times[0] == times[1]


def test_the_server_and_bench_default_is_realistic_and_the_backend_checks_its_choice():
    assert EngineConfig(backend="twin").twin_sensors == "realistic"
    assert EngineConfig(backend="twin", twin_sensors="ideal").twin_sensors == "ideal"
    with pytest.raises(ConfigError, match="twin_sensors"):
        EngineConfig(backend="twin", twin_sensors="perfect")
    with pytest.raises(ValueError, match="sensors"):
        TwinBackend(sensors="perfect")
