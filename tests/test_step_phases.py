"""The per-step phase timer: the engine's phases cover its step, and execute splits into forward and sampler
by what the backend reports."""

from __future__ import annotations

import time

from engine.baselines.seed import FixedPolicy
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from telemetry.phases import PHASES, PhaseTimer
from tests.fake_backend import FakeBackend

FORWARD_S, SAMPLER_S = 0.004, 0.002


class TimedBackend(FakeBackend):
    """Spends known times in its forward and in its sampler, and reports the sampler's."""

    sampler_seconds = 0.0

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        time.sleep(FORWARD_S)
        out = super().execute(batch)
        time.sleep(SAMPLER_S)
        self.sampler_seconds += SAMPLER_S
        return out


def test_timer_adds_spans_per_phase() -> None:
    timer = PhaseTimer()
    with timer.span("forward"):
        time.sleep(0.01)
    timer.add("sampler", 0.5)
    totals = timer.totals()
    assert set(totals) == set(PHASES)
    assert 0.01 <= totals["forward"] < 0.5 and totals["sampler"] == 0.5 and totals["controller"] == 0.0


def test_engine_phases_split_execute_and_cover_the_step() -> None:
    engine = LLMEngine(TimedBackend(), FixedPolicy())
    for i in range(4):
        engine.add_request(str(i), [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    t = engine.phase_totals()
    assert t["sampler"] == steps * SAMPLER_S  # exactly what the backend reported
    assert t["forward"] >= steps * FORWARD_S
    assert t["schedule"] > 0 and t["controller"] > 0 and t["telemetry"] > 0 and t["detokenize_stream"] > 0
    # the phases are the step: together they account for nearly all of its wall time, and never more
    assert 0.9 * wall <= sum(t.values()) <= wall
