"""A request refused for memory another process holds for now. In the fault campaign (bench/results/
fault_campaign.md) at (4, 4096, 4096), while another process held ~3.4 GiB, admission refused two requests
with 400 "request cannot fit in device memory" (too_long_for_memory): requests that fit the device otherwise,
and would have fit seconds later. A 400 is final and the shortage passes, so admission judges a request
against the device without what other processes hold now (the least memory ever seen outside the allocator,
controller/budget.py's external_floor): one that does not fit only because of them waits in the queue.
"""

from __future__ import annotations

import random

import pytest

from bench.loadgen import filler_prompt
from controller.adaptive import AdaptivePolicy
from engine.backends.twin.backend import TwinBackend
from engine.cli import engine_config
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from telemetry.record import MemorySample, StepRecord, StepShape
from telemetry.units import GIB, MIB
from tests.test_adaptive import CAPACITY, IDLE, prefill

CONTEXT = 400 * MIB  # the CUDA context: outside the allocator all along
LONG = SamplingParams(max_tokens=4096, ignore_eos=True)


def step_while_held(engine: LLMEngine, wants: int, steps: int) -> None:
    """`steps` engine steps, the other process asking for `wants` bytes before each (it takes what the driver
    has free and retries until it holds them all, as bench/fault_run.py's does)."""
    for _ in range(steps):
        engine.backend.set_external(wants)
        engine.step()


def test_a_request_that_fits_the_device_waits_out_another_process_and_completes() -> None:
    engine = build_engine(engine_config(["--backend", "twin", "--policy", "adaptive", "--twin-sensors", "realistic"]))
    running = [engine.add_request(f"r{i}", filler_prompt(i, 4096), LONG) for i in range(2)]
    for _ in range(100):
        engine.step()
    # Another process asks for 4 GiB; the allocator's cache goes back to the driver (torch.cuda.empty_cache), and it
    # takes that too. The KV pool shrinks to what the running requests need.
    engine.backend.memory.empty_cache()
    step_while_held(engine, 4 * GIB, 50)
    budget = engine.policy.memory.budget
    assert budget.budget.free_mib < 32  # not even a minimum chunk fits now ...
    assert budget.external > budget.external_floor + 3 * GIB  # ... for memory another process holds

    late = engine.add_request("late", filler_prompt(9, 4096), SamplingParams(max_tokens=64, ignore_eos=True))
    tokens = sum(len(s.output_ids) for s in running)
    step_while_held(engine, 4 * GIB, 100)
    assert late in engine.scheduler.waiting and not late.output_ids  # it waits ...
    assert sum(len(s.output_ids) for s in running) >= tokens + 90  # ... and the engine goes on without it

    engine.backend.set_external(0)  # the other process lets go
    while engine.has_unfinished():
        engine.step()
    assert late.finish_reason == "length" and len(late.output_ids) == 64
    assert all(len(s.output_ids) == LONG.max_tokens for s in running)


def record(step: int, shape: StepShape, peak_mib: float, outside: int) -> StepRecord:
    """A sampled step of a plant whose device shows `outside` bytes beside the allocator's."""
    reserved = IDLE + int(peak_mib * MIB)
    mem = MemorySample(
        peak_allocated=reserved,
        reserved=reserved,
        idle_baseline=IDLE,
        capacity=CAPACITY,
        device_used=reserved + outside,
    )
    return StepRecord(step, 0.0, 0.01, shape, mem, 10, 54, 64)


@pytest.mark.parametrize("co_tenant", [0, 2 * GIB])
def test_a_request_the_device_could_never_hold_is_still_refused(co_tenant: int) -> None:
    """A plant whose step peak grows 0.5 MiB per token in context: the 3 GiB above idle hold ~6000 tokens
    without the other process, ~2000 beside its 2 GiB. Not the twin's memory: its step memory does not grow
    with the context, so no request its KV pool takes is too long for it. The policy learns the plant from
    synthetic records, then admits in front of the twin backend."""
    pol, rng = AdaptivePolicy(), random.Random(1)
    for k in range(100):
        s = prefill(rng.randint(16, 256), context=rng.randint(0, 2048))
        pol.observe(record(k + 1, s, 1 + 0.5 * s.sum_context, CONTEXT + (co_tenant if k >= 50 else 0)))
    budget = pol.memory.budget
    assert budget.external == CONTEXT + co_tenant and budget.external_floor == CONTEXT
    engine = LLMEngine(TwinBackend(), pol)
    params = SamplingParams(max_tokens=16)
    engine.add_request("waits", filler_prompt(0, 4000), params)  # it waits out the other process
    with pytest.raises(RequestError) as e:
        engine.add_request("never", filler_prompt(1, 8000), params)
    assert e.value.code == "too_long_for_memory" and str(e.value).startswith("request cannot fit in device memory")
    assert list(engine.requests) == ["waits"]
