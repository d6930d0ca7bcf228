"""The checks of what the controller sees and does about memory: the KV pool in CUDA virtual memory, NVML beside
the allocator over a run, a real OOM that another process causes and the engine recovers from, and the sized KV
pool following another process's allocation. Each scenario runs on the device and, unchanged, on the twin with its
model of another process; each returns its figures and whether they meet the check's criterion, so the twin's
verdict stands beside the device's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import closing
from typing import Any

import torch

from bench.device_checks.ballast import Ballast, ProcessBallast, SimulatedBallast, TwinBallast
from bench.device_checks.common import (
    GIB,
    MIB,
    NO_CUDA,
    NO_NUMERICS,
    Load,
    Result,
    Session,
    Value,
    adaptive_engine,
    attach,
    fixed_engine,
    run,
    staggered,
    twin,
)
from controller.config import ControllerConfig
from engine.backends.torch_backend import TorchBackend
from engine.backends.twin.backend import TwinBackend
from engine.config import EngineConfig
from engine.core.kv.sizing import size_kv_pool
from engine.core.llm_engine import LLMEngine
from engine.factory import build_engine, build_policy
from engine.model.loaders import LoadedModel
from telemetry.record import StepRecord

MIN_READINGS = 10  # fresh NVML readings a run must give for their spread to mean anything
SPREAD_MIB = ControllerConfig().headroom_min_mib  # the controller's headroom floor
OOM_HOLD_STEPS = 3  # engine steps while the ballast holds all but too little for them
WAIT_S = 60.0  # for the second process to take what it asked for, before the OOM check's steps
Scenario = tuple[dict[str, Value], bool]  # the figures, and whether they meet the check's criterion


def empty_cache(backend: object) -> None:
    """torch.cuda.empty_cache() on the device, or on the twin's model of its allocator."""
    if isinstance(backend, TwinBackend):
        backend.memory.empty_cache()
    elif backend.device.type == "cuda":
        torch.cuda.empty_cache()


def side_by_side(r: Result, measured: Scenario | None, predicted: Scenario, skipped: str) -> None:
    """Every figure of the twin's run beside the device's (or `skipped`), and whether each met the criterion."""
    for label, value in predicted[0].items():
        r.figure(label, skipped if measured is None else measured[0][label], value)
    r.figure("meets the criterion", skipped if measured is None else measured[1], predicted[1])
    r.passed = None if measured is None else measured[1]


def nvml_readings(engine: LLMEngine, s: Session, reserved: Callable[[StepRecord], int]) -> Scenario:
    """The staggered NVML load; at each step whose NVML reading is fresh, its used bytes and the allocator's
    reserved bytes of that moment (`reserved`)."""
    pairs: list[tuple[int, int]] = []

    def read(record: StepRecord, _batch: object) -> None:
        m = record.memory
        if m.device_used is not None and m.device_used_reserved is None:  # read in this step, not held
            pairs.append((m.device_used, reserved(record)))

    engine.step_listeners.append(read)
    log = run(engine, staggered(s.plan.nvml))
    outside = [(used - held) / MIB for used, held in pairs]
    below = sum(used < held for used, held in pairs)
    spread = max(outside) - min(outside) if outside else None
    figures: dict[str, Value] = {
        "steps": log.steps,
        "fresh NVML readings": len(pairs),
        "readings where NVML used < allocator reserved": below,
        "NVML used - allocator reserved, least (MiB)": min(outside, default=None),
        "... median (MiB)": statistics.median(outside) if outside else None,
        "... most (MiB)": max(outside, default=None),
        "... spread, most - least (MiB)": spread,
        "requests lost": log.lost,
    }
    ok = len(pairs) >= MIN_READINGS and not below and spread is not None and spread <= SPREAD_MIB and not log.lost
    return figures, ok


def nvml_vs_allocator(s: Session) -> Result:
    r = Result(
        "nvml_vs_allocator",
        "NVML readings beside allocator readings over a run",
        f"at least {MIN_READINGS} fresh NVML readings; NVML's used bytes >= the allocator's reserved bytes at each; "
        f"what NVML sees beyond them (CUDA context, other processes) spreads by at most {SPREAD_MIB:.0f} MiB, the "
        "controller's headroom floor, which is what covers an error in its estimate of memory outside the allocator",
    )
    predicted = nvml_readings(fixed_engine(twin(), s.plan.nvml_batch), s, lambda record: record.memory.reserved)
    why = NO_CUDA
    if s.cuda:
        nvml = getattr(s.shared().probe, "nvml", None)
        why = "" if nvml is not None and nvml.available else "NVML unavailable (no pynvml, or no driver)"
    if why:
        side_by_side(r, None, predicted, why)
        return r.skip(why)
    engine = fixed_engine(s.shared(), s.plan.nvml_batch)
    side_by_side(r, nvml_readings(engine, s, lambda _record: torch.cuda.memory_reserved(s.device)), predicted, "")
    return r


RELEASE_SLACK = 64 * MIB  # free memory may differ by the allocator's small blocks, not by a pool


def vmm_pool(s: Session) -> Result:
    r = Result(
        "vmm_pool",
        "The KV pool in CUDA virtual memory",
        "on CUDA the shared backend's pool is in CUDA virtual memory; a second pool of blocks half a granule in "
        "size maps one granule for every two blocks (blocks share granules), and once its backend is dropped "
        f"the driver's free memory is back within {RELEASE_SLACK / MIB:.0f} MiB of what it was before it",
    )
    if not s.cuda:
        return r.skip(NO_CUDA)
    shared = s.shared()
    r.figure("the shared backend's KV pool", shared.kv_layout, NO_NUMERICS)
    arena = shared.kv_arena
    if arena is None:
        r.passed = False
        return r
    granule = arena.driver.granularity
    r.figure("driver granularity (MiB)", granule / MIB, NO_NUMERICS)
    r.figure("block bytes, Llama-3.1-8B shape (MiB)", arena.block_bytes / MIB, NO_NUMERICS)
    half = max(1, shared.block_size * granule // (2 * arena.block_bytes))  # tokens a block of half a granule holds
    blocks = 1024 + 1  # odd: the last granule holds one block
    s.synchronize()
    before = torch.cuda.mem_get_info(s.device)[0]
    model = LoadedModel(shared.model, shared.config, shared.tokenizer, shared.model_name)
    other = TorchBackend(model, dtype=s.dtype, device=s.device, num_blocks=blocks, block_size=half,
                         model_cache=False, enforce_eager=True)  # fmt: skip
    other_arena = other.kv_arena
    mapped = other_arena.mapped_bytes if other_arena is not None else None
    took = before - torch.cuda.mem_get_info(s.device)[0]
    del other, other_arena
    s.free()
    back = torch.cuda.mem_get_info(s.device)[0]
    want = -(-blocks // 2) * granule
    r.figure(f"second pool: {blocks} blocks of {half} tokens, mapped (MiB)", mapped and mapped / MIB, NO_NUMERICS)
    r.figure("... granules it should map, one for two blocks (MiB)", want / MIB, NO_NUMERICS)
    r.figure("device memory the second backend took (MiB)", took / MIB, NO_NUMERICS)
    r.figure("free memory after it was dropped, minus before it (MiB)", (back - before) / MIB, NO_NUMERICS)
    r.passed = mapped == want and abs(back - before) <= RELEASE_SLACK
    return r


def step_until(engine: LLMEngine, before: Callable[[], None], done: Callable[[], bool], limit: int) -> int | None:
    """Engine steps, `before` each, until `done`: how many, or None when it is not done after `limit` steps."""
    for steps in range(limit):
        if done():
            return steps
        before()
        engine.step()
    return limit if done() else None


def never() -> bool:
    return False


def oom_scenario(engine: LLMEngine, ballast: Ballast, load: Load) -> Scenario:
    """`load` requests start decoding; the allocator's cache goes back to the driver and the ballast takes all the
    driver has free but a quarter of what the median step with a prompt took so far; as many requests again
    arrive, so the next steps need more than is left. After OOM_HOLD_STEPS steps the ballast lets go (its process
    exits) and every request runs to its end. A quarter, not nothing: the driver keeps room to load a kernel's
    code on its first launch, which would fail outside the allocator (not as torch.OutOfMemoryError)."""
    log, retry = attach(engine), ballast.before_step
    for i in range(load.requests):
        log.send(engine, i, load.prompt, load.tokens)
    decoding = step_until(engine, retry, lambda: all(q.output_ids for q in engine.requests.values()), 10_000)
    leave = int(statistics.median(log.prefill_peaks or [0])) // 4
    empty_cache(engine.backend)  # the next steps must ask the driver for memory
    ballast.take(max(0, ballast.free_bytes() - leave))
    took, held = ballast.wait(WAIT_S), ballast.held
    for i in range(load.requests, 2 * load.requests):
        log.send(engine, i, load.prompt, load.tokens)
    before = log.ooms
    step_until(engine, retry, never, OOM_HOLD_STEPS)
    while_held = log.ooms - before
    ballast.close()
    drained = step_until(engine, retry, lambda: not engine.has_unfinished(), 100_000) is not None
    figures: dict[str, Value] = {
        "first requests all decoding before the ballast": decoding is not None,
        "ballast held (GiB)": held / GIB,
        "ballast took all it asked for": took,
        "left free: a quarter of the median step with a prompt (MiB)": leave / MIB,
        f"OOMs in the {OOM_HOLD_STEPS} steps while it held": while_held,
        "OOMs recovered, all told": engine.ooms_recovered,
        "requests": len(log.wanted),
        "requests lost (not finished with every token)": log.lost,
        "engine healthy and drained": engine.healthy and drained,
    }
    return figures, while_held >= 1 and took and not log.lost and engine.healthy and drained


def oom_recovery(s: Session) -> Result:
    r = Result(
        "oom_recovery",
        "A real OOM caused by a second process's ballast, recovered with 0 lost requests",
        "the steps while the ballast held all but a quarter of the median step with a prompt ran out of memory "
        "(torch.OutOfMemoryError) at least once, the engine recovered (the adaptive policy and the production "
        "recovery), and every request finished with all its tokens after the ballast's process exited",
    )
    backend = twin()
    predicted = oom_scenario(adaptive_engine(backend), TwinBallast(backend), s.plan.oom)
    s.free(shared=True)
    engine = adaptive_engine(s.backend())
    ballast: Any = ProcessBallast(s.device) if s.cuda else SimulatedBallast(engine.backend)
    with closing(ballast):
        side_by_side(r, oom_scenario(engine, ballast, s.plan.oom), predicted, "")
    if not s.cuda:
        r.notes.append(
            "simulated: on the CPU no second process can take this one's memory, so while the ballast holds, every "
            "step raises torch.OutOfMemoryError (bench/device_checks/ballast.py SimulatedBallast)"
        )
    return r


def sized_engine(s: Session, **backend_args: Any) -> LLMEngine:
    """The production engine over the random weights: adaptive, its KV pool sized at start-up and every graph
    captured after (engine/factory.py build_engine, which loads its model by name)."""
    policy = build_policy(EngineConfig(device=str(s.device)))
    backend = s.backend(pool_tokens=policy.kv_pool_profile().prefill_tokens, **backend_args)  # type: ignore[union-attr]
    engine = LLMEngine(backend, policy)
    size_kv_pool(engine)
    backend.capture_graphs()
    return engine


def follow_scenario(
    engine: LLMEngine, ballast: Ballast, load: Load, steps: tuple[int, ...]
) -> tuple[Scenario, list[int]]:
    """`load.requests` clients in a closed loop; after the warm-up steps the ballast asks for what the driver has
    free plus a quarter of the pool, holds it for some steps once it has it all, and exits. Also returns the
    pool's size in blocks after every step."""
    warm, take_limit, hold, grow_limit = steps
    log, alloc, block = attach(engine), engine.allocator, engine.backend.block_bytes
    pool: list[int] = []
    engine.step_listeners.append(lambda _record, _batch: pool.append(alloc.num_blocks))
    sending = True

    def before() -> None:
        ballast.before_step()
        while sending and len(engine.requests) < load.requests:
            log.send(engine, len(log.wanted), load.prompt, load.tokens)

    step_until(engine, before, never, warm)
    start, ask, asked_at = alloc.num_blocks, ballast.free_bytes() + alloc.num_blocks * block // 4, len(pool)
    ballast.take(ask)
    took = step_until(engine, before, lambda: ballast.held >= ask, take_limit)
    step_until(engine, before, never, hold)
    low = min(pool[asked_at:], default=start)
    ballast.close()
    grew = step_until(engine, before, lambda: alloc.num_blocks >= 0.9 * start, grow_limit)
    sending = False
    drained = step_until(engine, before, lambda: not engine.has_unfinished(), 100_000) is not None
    counters = engine.policy.state()["counters"]
    figures: dict[str, Value] = {
        "KV pool before (GiB)": start * block / GIB,
        "asked by the other process: what is free + a quarter of the pool (GiB)": ask / GIB,
        f"steps until it held all it asked for (at most {take_limit})": took,
        "KV pool at its least after it asked (GiB)": low * block / GIB,
        f"steps until the pool grew back to 90% after the process exited (at most {grow_limit})": grew,
        "KV pool at the end (GiB)": alloc.num_blocks * block / GIB,
        "pool resizes": counters["kv_pool_resizes"],
        "sequences preempted to shrink the pool": counters["kv_pool_preemptions"],
        "OOMs (recovered)": log.ooms,
        "requests": len(log.wanted),
        "requests lost": log.lost,
        "engine healthy and drained": engine.healthy and drained,
    }
    ok = took is not None and low < start and grew is not None and not log.lost and engine.healthy and drained
    return (figures, ok), pool


def pool_follows(s: Session) -> Result:
    r = Result(
        "pool_follows",
        "The KV pool following a second process's allocation",
        "the second process got all it asked for (what was free + a quarter of the pool) within the step limit, "
        "which takes the pool shrinking; once it exited, the pool grew back to 90% within the step limit; 0 "
        "requests lost (OOMs in between are counted, not failed: the other process can take memory between the "
        "controller's reading and a step)",
    )
    engine = build_engine(EngineConfig(backend="twin", twin_sensors="realistic"))
    predicted, r.series["twin_pool_blocks"] = follow_scenario(
        engine, TwinBallast(engine.backend), s.plan.follow, s.plan.follow_steps
    )
    if not s.cuda:
        side_by_side(r, None, predicted, NO_CUDA)
        return r.skip(NO_CUDA)
    s.free(shared=True)
    engine = sized_engine(s)
    with closing(ProcessBallast(s.device)) as ballast:
        measured, r.series["pool_blocks"] = follow_scenario(engine, ballast, s.plan.follow, s.plan.follow_steps)
    side_by_side(r, measured, predicted, "")
    return r
