"""The fault campaign (bench/fault_campaign.py, bench/fault_run.py) on small loads: its fields, one fault
schedule for the realistic and the ideal run, and counters that count: an engine that dies on an OOM, one
that stops going on, a KV pool the device does not hold, and a fragmented cache are each seen."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from bench.fault_campaign import TARGETS, Load, campaign, drive, trace_load, twin_engine
from bench.fault_run import ArmedOOMs, Fault, Rates, schedule
from engine.backends.twin.memory import MemoryModel, StepMemory
from engine.backends.twin.profile import load_profile
from engine.cli import engine_config
from engine.factory import build_engine
from telemetry.units import MIB

DENSE = Rates(external_s=0.5, fragment_s=0.2, oom_s=1.0)  # every kind several times in a few seconds
OFF = 1e9
SMALL = Load("4x256x256", (4, 256, 256), 8)


def first(faults: Iterator[Fault], n: int = 60) -> list[Fault]:
    return list(itertools.islice(faults, n))


def test_the_schedule_is_fixed_by_its_seed_and_ordered_in_time() -> None:
    a = first(schedule("0/x", DENSE))
    assert a == first(schedule("0/x", DENSE))
    assert a != first(schedule("1/x", DENSE))
    assert [f.t for f in a] == sorted(f.t for f in a)
    assert {f.kind for f in a} == {"external", "fragment", "oom"}


def test_a_small_campaign_reports_every_field_and_both_runs_meet_the_same_faults() -> None:
    doc = campaign([SMALL, trace_load(limit=12)], rates=DENSE)
    for field in (*TARGETS, "requests", "throughput_vs_ideal", "loads", "ideal", "same_schedule", "met"):
        assert field in doc
    assert doc["requests"] == 20 and doc["same_schedule"]
    assert doc["throughput_vs_ideal"] == min(r["throughput_vs_ideal"] for r in doc["loads"])
    for row in doc["loads"]:
        real, ideal = row["realistic"], row["ideal"]
        assert real["lost"] == row["requests"] - real["completed"]
        assert real["ooms"] >= real["ooms_injected"] > 0
        assert set(real["faults"]) == set(ideal["faults"]) == {"external", "fragment", "oom"}


def test_the_realistic_and_the_ideal_run_apply_the_same_faults_at_the_same_times() -> None:
    runs = [drive(twin_engine(s), SMALL, schedule("0/same", DENSE))[1] for s in ("realistic", "ideal")]
    n = min(map(len, runs))
    assert n > 10 and runs[0][:n] == runs[1][:n]
    other = drive(twin_engine("ideal"), SMALL, schedule("1/same", DENSE))[1]
    assert other[:n] != runs[0][:n]


def test_an_engine_that_dies_on_an_oom_loses_requests_and_its_oom_is_unrecovered() -> None:
    engine = build_engine(engine_config(["--backend", "twin", "--policy", "seed-static", "--twin-sensors", "ideal"]))
    counters, applied = drive(engine, SMALL, schedule("0/dies", Rates(OFF, OFF, 0.5)))
    assert counters["ooms_injected"] == 1 and counters["unrecovered_ooms"] == 1
    assert counters["lost"] == SMALL.requests - counters["completed"] > 0


def test_an_engine_that_stops_going_on_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: ArmedOOMs, batch: object) -> None:  # every step fails, 0.1 s each
        import torch

        self.advance_to(self.now() + 0.1)
        raise torch.OutOfMemoryError("always")

    monkeypatch.setattr(ArmedOOMs, "execute", fail)
    counters, _ = drive(twin_engine("ideal"), SMALL, schedule("0/stuck", Rates(OFF, OFF, OFF)))
    assert counters["error"].startswith("Stalled") and counters["unrecovered_ooms"] == 1
    assert counters["completed"] == 0 and counters["lost"] == SMALL.requests


def test_a_pool_the_device_does_not_hold_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = Rates(OFF, OFF, OFF)
    assert drive(twin_engine("ideal"), SMALL, schedule("0/pool", quiet))[0]["pool_below_held"] == 0
    # a backend whose resize says yes and keeps the start-up pool (a few blocks) on the device
    monkeypatch.setattr(MemoryModel, "resize_pool", lambda self, num_blocks: False)
    counters, _ = drive(twin_engine("ideal"), SMALL, schedule("0/pool", quiet))
    assert counters["pool_below_held"] > 0


def test_fragmentation_pins_split_segments_against_a_flush_until_its_next_turn() -> None:
    m = MemoryModel(load_profile(), 64, 256)
    m.run_step(StepMemory(0, 0, 0))
    m.fragment((100 * MIB, 4 * MIB, 60 * MIB, 2 * MIB))
    assert m.allocated == 6 * MIB  # the pins live; the holes are cached
    m.empty_cache()
    assert m.reserved >= 166 * MIB  # one segment, split by the pins: no flush gives it back
    m.fragment((30 * MIB, 2 * MIB))  # the next turn lets go of the old pins and pins anew
    assert m.allocated == 2 * MIB
    m.fragment(())
    m.empty_cache()
    assert m.allocated == m.reserved == 0
