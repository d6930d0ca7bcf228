"""An OOM storm: in the fault campaign (bench/results/fault_campaign.md) at (4, 256, 4096), realistic sensors,
1,234 OOMs came in streaks of 250-500 failed steps in a row. Each step of a streak failed on a 2 MiB small-pool
segment for a 1-row decode: the other process, short of what it asked for and asking again before every step,
had taken every byte the driver had free, including what the OOM recovery's empty_cache handed back; and the
previous step's retained logits (the twin's engine keeps them until the next step's replace them) pinned an
almost free large-pool segment, which no flush can return and no small request can use. The recovery now lets
go of the retained output and keeps the cache: a cudaMalloc that fails releases the cached segments and
retries at once, for this process (TwinBackend.recover_from_oom).
"""

from __future__ import annotations

from bench.fault_run import MAX_EXTERNAL, ArmedOOMs
from bench.loadgen import filler_prompt
from controller.adaptive import AdaptivePolicy
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.memory import StepMemory
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams

MAX_STEPS = 400


def test_an_oom_storm_ends_and_loses_no_request() -> None:
    """A request decodes alone, three short ones join it (their decodes' logits, more than 1 MiB, go to the
    large pool), another process starts asking for memory before every step, and an OOM strikes when the
    short ones have finished (as bench/fault_run.py's injected ones do). Before the fix every later 1-row
    decode failed for as long as the other process held on."""
    twin = TwinBackend(sensors="realistic")
    backend = ArmedOOMs(twin)
    engine = LLMEngine(backend, AdaptivePolicy())
    long = engine.add_request("long", filler_prompt(0, 32), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [long] + [engine.add_request(f"s{i}", filler_prompt(i + 1, 32), short) for i in range(3)]
    streak = longest = steps = 0
    other_process = armed = False
    while engine.has_unfinished() and steps < MAX_STEPS:
        other_process |= len(engine.scheduler.running) == 4
        if other_process:
            twin.set_external(MAX_EXTERNAL)  # it never gets all of it: it takes every free byte, every step
        if other_process and len(engine.scheduler.running) == 1 and not armed:
            backend.armed = armed = True
        before = engine.ooms
        engine.step()
        steps += 1
        streak = streak + 1 if engine.ooms > before else 0
        longest = max(longest, streak)
    assert armed and twin.memory.external > 0
    assert longest <= 2, f"{longest} failed steps in a row"
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.max_tokens for s in seqs)


def test_the_recovery_lets_go_of_the_output_that_pins_a_segment() -> None:
    """The mechanism alone: a 4-row decode's logits sit in the cached 42 MiB workspace segment of the prefill
    before it; the cache is flushed around them, another process takes every free byte, and a 1-row decode
    needs a 2 MiB small-pool segment. It fails; after the recovery the same step runs."""
    backend = TwinBackend(sensors="realistic")
    m = backend.memory
    assert m.run_step(StepMemory(256, 1, 1)).oom is None  # a prefill: workspace and logits segments
    assert m.run_step(StepMemory(4, 4, 0)).oom is None  # its logits (1.96 MiB) in the workspace's segment
    m.empty_cache()
    backend.set_external(MAX_EXTERNAL)
    assert m.driver_free == 0 and m.reserved > 20 * (1 << 20)  # all the cache left is one pinned segment
    one_row = StepMemory(1, 1, 0)
    assert m.run_step(one_row).oom is not None
    backend.recover_from_oom()
    assert m.run_step(one_row).oom is None
