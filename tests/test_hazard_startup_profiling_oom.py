"""Issue #25, hazard 5: start-up profiling (engine/core/kv/sizing.py) halves a step that runs out of memory; where
even a 1-token prefill or a 1-row decode runs out, or the probe never measures a step, it used to retry forever and
`headroom serve` hung. It must stop with an error that says so. The fake counts the steps and fails the test after
`STEP_LIMIT`, so the old code fails here instead of hanging."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.cli import engine_config
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.kv import sizing
from engine.core.kv.sizing import profile
from engine.core.llm_engine import LLMEngine
from engine.factory import build_engine
from telemetry.record import MemorySample

STEP_LIMIT = 100  # far more steps than halving 1024 tokens or 256 rows down to 1 takes


def engine_whose_steps(monkeypatch: pytest.MonkeyPatch, oom: Callable[[SchedulerOutput], bool]) -> LLMEngine:
    """A twin engine (a fixed pool of 64 blocks) whose steps run out of memory where `oom(batch)`; each step is
    counted in `engine.steps`."""
    engine = build_engine(engine_config(["--backend", "twin", "--num-blocks", "64"]))
    execute, steps = engine.backend.execute, []

    def step(batch: SchedulerOutput) -> ModelOutput:
        steps.append(batch)
        if len(steps) > STEP_LIMIT:
            raise AssertionError(f"profile() ran {STEP_LIMIT} steps and goes on: it would never end")
        if oom(batch):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return execute(batch)

    monkeypatch.setattr(engine.backend, "execute", step)
    engine.steps = steps  # type: ignore[attr-defined]
    return engine


@pytest.mark.timeout(60)
def test_a_one_token_prefill_that_runs_out_of_memory_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_whose_steps(monkeypatch, lambda batch: True)
    with pytest.raises(RuntimeError, match="1-token prefill step runs out of memory") as err:
        profile(engine, 1024, 256)
    assert "no room" in str(err.value) and "64 blocks" in str(err.value)
    assert len(engine.steps) == 11  # 1024, 512, ..., 1 tokens


@pytest.mark.timeout(60)
def test_a_one_row_decode_that_runs_out_of_memory_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_whose_steps(monkeypatch, lambda batch: not any(item.is_prefill for item in batch.items))
    with pytest.raises(RuntimeError, match="1-row decode step runs out of memory"):
        profile(engine, 1024, 256)
    assert len(engine.steps) == 2 + 9  # two prefills, then 256, 128, ..., 1 rows


@pytest.mark.timeout(60)
def test_a_probe_that_never_samples_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_whose_steps(monkeypatch, lambda batch: False)
    monkeypatch.setattr(engine.backend.probe, "sample", lambda: MemorySample(capacity=1 << 30, sampled=False))
    monkeypatch.setattr(sizing, "MAX_UNSAMPLED_STEPS", 8, raising=False)  # the real bound is 1024 steps
    with pytest.raises(RuntimeError, match="measured none of 8 steps"):
        profile(engine, 1024, 256)
    assert len(engine.steps) == 8


def test_profiling_that_fits_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills that fit only at 256 tokens restart the back-to-back pair there; the decode fits at 64 rows."""
    engine = engine_whose_steps(
        monkeypatch,
        lambda batch: batch.shape.prefill_tokens > 256 or len(batch.items) > 64,
    )
    samples = profile(engine, 1024, 256)
    assert len(samples) == 3 and all(s.sampled for s in samples)
    sizes = [(sum(i.num_tokens for i in b.items), len(b.items)) for b in engine.steps]
    assert sizes == [(1024, 1), (512, 1), (256, 1), (256, 1), (256, 256), (128, 128), (64, 64)]
