"""bench/device_check.py's smoke mode (--device cpu --tiny): the script a lent GPU runs is known to work
before one appears, and it writes where the device tool collects ($OUT)."""

from __future__ import annotations

import json
import sys

import pytest

from bench import device_check


def test_tiny_cpu_run_measures_every_item_beside_the_twin(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["device_check", "--device", "cpu", "--tiny"])
    device_check.main()
    report = json.loads((tmp_path / "device_check.json").read_text())
    plan = device_check.TINY_PLAN
    assert [int(b) for b in report["tpot_ms"]] == list(plan.batches)
    for row in report["tpot_ms"].values():
        assert row["eager"] > 0 and row["twin_4090"] > 0 and "graphs" not in row  # no graphs on the CPU
    assert report["prefill"]["tokens"] == plan.prefill_len and report["prefill"]["twin_4090_peak_mib"] > 0
    resize = report["resize"]
    assert resize["grow_ms"] > 0 and resize["shrink_ms"] > 0 and resize["twin_4090_grow_ms"] > 0
    assert resize["num_blocks_after"] == plan.num_blocks  # grown and shrunk back
    text = (tmp_path / "device_check.md").read_text()
    assert "twin 4090" in text and "attention cpu" in text


def test_the_gpu_model_has_llama_3_1_8b_shape() -> None:
    cfg = device_check.llama31_8b_config()
    params = (
        cfg.vocab_size * cfg.hidden_size * 2
        + cfg.num_layers
        * (
            cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            + cfg.num_heads * cfg.head_dim * cfg.hidden_size
            + 3 * cfg.hidden_size * cfg.intermediate_size
            + 2 * cfg.hidden_size
        )
        + cfg.hidden_size
    )
    assert params == 8_030_261_248  # Llama-3.1-8B's parameter count (the twin profile's weight_bytes / 2)
