"""The controller-sized KV pool on the real CPU engine (issue #15): SmolLM2 against an emulated 1 GiB
device with no --num-blocks. 64 requests with mixed prompt lengths at once, every step tracked so every
step that would cross the emulated capacity raises: all finish, no emulated OOM, and the pool the start-up
profiling step sized fills the capacity its parts leave. bench/cpu_sized_pool.py runs the longer version
(prompts up to 768 tokens) and times a resize. float32 for speed on CPUs without bf16 instructions."""

from __future__ import annotations

import pytest

from bench.cpu_sized_pool import build, run


@pytest.mark.timeout(300)
def test_sized_pool_serves_64_mixed_prompts_without_an_emulated_oom() -> None:
    engine = build("1GiB", "float32")
    sizing = engine.policy.state()["kv_pool"]["start_up"]
    assert engine.policy.state()["kv_pool"]["sized"]
    parts = ("external", "idle_without_pool", "headroom", "reserve")
    assert sizing["num_blocks"] == (sizing["capacity"] - sum(sizing[k] for k in parts)) // sizing["block_bytes"]
    out = run(engine, requests=64, min_prompt=8, max_prompt=96, max_tokens=4)
    assert (out.finished, out.ooms, out.emulated_ooms, out.untracked_steps) == (64, 0, 0, 0)
    assert engine.allocator.num_used == 0 and out.steps > 0
