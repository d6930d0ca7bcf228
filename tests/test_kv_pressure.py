"""bench/kv_pressure.py: the step accounting behind bench/results/kv_pressure.md."""

from __future__ import annotations

import pytest

from bench.kv_pressure import measure
from engine.cli import engine_config

SMALL, LARGE = ["--backend", "twin", "--num-blocks", "12"], ["--backend", "twin", "--num-blocks", "64"]


def test_a_small_pool_shows_recompute_and_a_large_one_none(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HEADROOM_CONTROLLER_KV_PREEMPT_SWAP", "false")
    small = measure(engine_config(SMALL), (4, 32, 1024))
    large = measure(engine_config(LARGE), (4, 32, 1024))
    assert small["preemptions"] > 0 and small["recomputed tokens"] > 0 and small["recompute steps"] > 0
    assert large["preemptions"] == large["recomputed tokens"] == large["recompute steps"] == 0
    assert small["mean decode batch (time-weighted)"] < large["mean decode batch (time-weighted)"] <= 4
    assert 0 < small["share of bound"] <= 1.0 and 0 < large["share of bound"] <= 1.0


def test_preemption_by_swap_recomputes_nothing():
    swapped = measure(engine_config(SMALL), (4, 32, 1024))
    assert swapped["preemptions"] > 0 and swapped["recomputed tokens"] == 0
