"""The KV pool sized by the controller at start-up (issue #15): profile the largest step the pool must
leave room for, then let the policy choose the size (controller/kv_pool.py says how).

Like vLLM's profile run, the profiling step is a real step on the backend (the twin replays its
allocations; torch runs the model) under the real probe: a prefill of `tokens` prompt tokens, twice back
to back, so what the first leaves allocated into the second (an engine that keeps its last logits) is
measured too. It runs on a pool just big enough for it, before any request; a step that runs out of
memory is retried at half the tokens.
"""

from __future__ import annotations

import logging

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import Sequence
from telemetry.record import MemorySample

log = logging.getLogger(__name__)
PROFILE_STEPS = 2
PROFILE_VOCAB = 1000  # filler prompt ids 1..1000: ordinary tokens in every vocabulary we load


def profile_blocks(tokens: int, block_size: int) -> int:
    """The pool a profiling step of `tokens` needs."""
    return -(-tokens // block_size)


def profile(engine: LLMEngine, tokens: int) -> list[MemorySample]:
    """What `PROFILE_STEPS` prefill steps of `tokens` prompt tokens measured (sampled ones only)."""
    backend, alloc = engine.backend, engine.allocator
    samples: list[MemorySample] = []
    while len(samples) < PROFILE_STEPS:
        seq = Sequence(
            f"profile-{len(samples)}",
            [1 + j % PROFILE_VOCAB for j in range(tokens)],
            SamplingParams(max_tokens=1),
            max_tokens=1,
            arrival_time=backend.now(),
        )
        seq.block_table = alloc.allocate(alloc.blocks_for(tokens))
        batch = ScheduledBatch()
        batch.add(ScheduledSeq(seq, 0, tokens, is_prefill=True))
        try:
            with backend.probe.step(batch.shape):
                backend.execute(batch)
        except torch.OutOfMemoryError:
            backend.recover_from_oom()
            samples.clear()
            tokens = max(1, tokens // 2)
            continue
        finally:
            alloc.free(seq.block_table)
        sample = backend.probe.sample()
        if sample.sampled:
            samples.append(sample)
    return samples


def size_kv_pool(engine: LLMEngine) -> int:
    """Profile, let the policy size the pool, resize to it; returns the pool size."""
    policy, alloc = engine.policy, engine.allocator
    samples = profile(engine, policy.cfg.pool_reserve_tokens)
    target = policy.size_kv_pool(alloc.num_blocks, engine.backend.block_bytes, samples)
    old = alloc.num_blocks
    plan = engine.resize_kv_pool(target)
    policy.observe_pool(old, plan.num_blocks if plan else old)
    log.info("KV pool sized by the controller: %s", policy.pool.sizing)
    return alloc.num_blocks
