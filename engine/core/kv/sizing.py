"""The KV pool sized by the controller at start-up: profile the largest step the pool must
leave room for, then let the policy choose the size (the adaptive policy's rules: controller/pool_rules.py).

Like vLLM's profile run, the profiling steps are real steps on the backend (the twin replays their
allocations; torch runs the model) under the real probe, before any request: a prefill of `tokens` prompt
tokens, twice back to back, so what the first leaves allocated into the second (an engine that keeps its
last logits) is measured too; then a decode step of `rows` sequences, the largest decode batch the
controller may run (vLLM's profile run likewise ends with a sampler run at max_num_seqs rows). An engine
that computes logits for every prompt token needs the most for the prefill; one that computes them only
for sampled rows (vLLM) needs the most for the decode batch: 256 rows of a 128,256-token vocabulary are
about 125 MiB of fp32 logits and as much again of sampler probabilities, where its 1024-token prefill
samples one row. Profiled with the prefill alone, the vLLM twin's pool left a reserve of one block
(2 MiB) and the controller could then decode one sequence a step. A step that runs out of memory is
retried at half its tokens (or rows); where even one token (or row) runs out, no step fits and start-up stops
with StartupProfilingError rather than retry forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from controller.policy import PoolResize
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from telemetry.record import MemorySample
from telemetry.units import format_bytes

log = logging.getLogger(__name__)
PROFILE_STEPS = 2
PROFILE_VOCAB = 1000  # filler prompt ids 1..1000: ordinary tokens in every vocabulary we load
# The CPU probe measures a repeated shape every 8th step, and skips those while its tracking has cost more than
# 0.5% of the step time, which a small model's cheap steps can take several hundred steps to dilute; CUDA and the
# twin measure every step. A probe that measures none of this many in a row never will.
MAX_UNSAMPLED_STEPS = 1024


class StartupProfilingError(RuntimeError):
    """Start-up profiling cannot measure a step: `headroom serve` stops with the reason instead of looping."""


def profile_blocks(tokens: int, block_size: int) -> int:
    """The pool a profiling step of `tokens` needs."""
    return -(-tokens // block_size)


def profile(engine: LLMEngine, tokens: int, rows: int) -> list[MemorySample]:
    """What `PROFILE_STEPS` prefill steps of `tokens` prompt tokens and then a decode step of `rows`
    sequences measured (sampled ones only)."""
    samples: list[MemorySample] = []

    def prefill(n: int) -> list[Sequence]:
        return [_filler(f"profile-{len(samples)}", n, engine)]

    def decode(n: int) -> list[Sequence]:  # the rows share one block: each writes its one slot there
        return [_filler(f"profile-decode-{i}", 1, engine) for i in range(n)]

    while len(samples) < PROFILE_STEPS:
        sample, fitted = _sampled_step(engine, prefill, tokens, True, "1-token prefill")
        if fitted < tokens:  # restart the back-to-back pair at the size that fits
            samples.clear()
            tokens = fitted
        samples.append(sample)
    return [*samples, _sampled_step(engine, decode, rows, False, "1-row decode")[0]]


def _sampled_step(
    engine: LLMEngine, seqs: Callable[[int], list[Sequence]], size: int, is_prefill: bool, smallest: str
) -> tuple[MemorySample, int]:
    """The first sampled step of `seqs(size)`, halving `size` after each step that runs out of memory, and the
    size it ran at. Raises StartupProfilingError where a step of size 1 runs out too, or none is sampled."""
    unsampled = 0
    while True:
        sample = _profile_step(engine, seqs(size), is_prefill)
        if sample is None:
            if size <= 1:
                raise StartupProfilingError(_no_room(engine, smallest))
            size //= 2
        elif sample.sampled:
            return sample, size
        else:
            unsampled += 1
            if unsampled >= MAX_UNSAMPLED_STEPS:
                raise StartupProfilingError(
                    f"start-up profiling: the memory probe ({engine.backend.probe.name}) measured none of "
                    f"{unsampled} steps in a row, so the step the KV pool must leave room for is unknown"
                )


def _no_room(engine: LLMEngine, step: str) -> str:
    backend, alloc = engine.backend, engine.allocator
    last = backend.probe.sample()
    seen = f"; the step peaked at {format_bytes(last.peak_allocated)} of {format_bytes(last.capacity)}"
    return (
        f"start-up profiling: even a {step} step runs out of memory: the device has no room for one after the "
        f"weights and the minimum KV pool ({alloc.num_blocks} blocks, "
        f"{format_bytes(alloc.num_blocks * backend.block_bytes)}){seen if last.capacity else ''}"
    )


def _filler(request_id: str, tokens: int, engine: LLMEngine) -> Sequence:
    return Sequence(
        request_id,
        [1 + j % PROFILE_VOCAB for j in range(tokens)],
        SamplingParams(max_tokens=1),
        max_tokens=1,
        arrival_time=engine.backend.now(),
    )


def _profile_step(engine: LLMEngine, seqs: list[Sequence], is_prefill: bool) -> MemorySample | None:
    """One step computing every token of `seqs` from position 0 (a prefill of the first, or a decode of
    one-token sequences sharing one block); None if it ran out of memory."""
    backend, alloc = engine.backend, engine.allocator
    blocks = alloc.allocate(alloc.blocks_for(max(s.num_tokens for s in seqs)))
    batch = SchedulerOutput()
    for seq in seqs:
        seq.block_table = blocks
        batch.add(ScheduledItem.of(seq, 0, seq.num_tokens, is_prefill=is_prefill))
    try:
        with backend.probe.step(batch.shape):
            backend.execute(batch)
    except torch.OutOfMemoryError:
        backend.recover_from_oom()
        return None
    finally:
        alloc.free(blocks)
    return backend.probe.sample()


def size_kv_pool(engine: LLMEngine) -> int:
    """Profile as the policy asks, let it size the pool, resize to it; returns the pool size. A resize that
    fails here raises: start-up stops rather than serve from the profiling steps' pool."""
    policy, alloc, block_bytes = engine.policy, engine.allocator, engine.backend.block_bytes
    wanted = policy.kv_pool_profile()
    if wanted is None:
        raise ValueError(f"policy {policy.name!r} does not size the KV pool")
    samples = profile(engine, wanted.prefill_tokens, wanted.decode_rows)
    old = alloc.num_blocks
    target = policy.kv_pool_start(old, block_bytes, samples)
    engine.resize_kv_pool(target.num_blocks)
    policy.observe_pool(PoolResize(target, old, alloc.num_blocks))
    log.info("KV pool sized by the controller: %d -> %d blocks of %s", old, alloc.num_blocks, format_bytes(block_bytes))
    return alloc.num_blocks
