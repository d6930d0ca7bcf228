"""The KV pool sized by the controller at start-up: profile the largest step the pool must
leave room for, then let the policy choose the size (controller/kv_pool.py says how).

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
retried at half its tokens (or rows).
"""

from __future__ import annotations

import logging

import torch

from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from telemetry.record import MemorySample

log = logging.getLogger(__name__)
PROFILE_STEPS = 2
PROFILE_VOCAB = 1000  # filler prompt ids 1..1000: ordinary tokens in every vocabulary we load


def profile_blocks(tokens: int, block_size: int) -> int:
    """The pool a profiling step of `tokens` needs."""
    return -(-tokens // block_size)


def profile(engine: LLMEngine, tokens: int, rows: int) -> list[MemorySample]:
    """What `PROFILE_STEPS` prefill steps of `tokens` prompt tokens and then a decode step of `rows`
    sequences measured (sampled ones only)."""
    samples: list[MemorySample] = []
    while len(samples) < PROFILE_STEPS:
        sample = _profile_step(engine, [_filler(f"profile-{len(samples)}", tokens, engine)], True)
        if sample is None:
            samples.clear()
            tokens = max(1, tokens // 2)
        elif sample.sampled:
            samples.append(sample)
    while True:  # the decode rows share one block: each writes its one slot there, only the memory matters
        sample = _profile_step(engine, [_filler(f"profile-decode-{i}", 1, engine) for i in range(rows)], False)
        if sample is None:
            rows = max(1, rows // 2)
        elif sample.sampled:
            return [*samples, sample]


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
    """Profile, let the policy size the pool, resize to it; returns the pool size."""
    policy, alloc = engine.policy, engine.allocator
    samples = profile(engine, policy.cfg.pool_reserve_tokens, policy.cfg.max_decode_seqs)
    target = policy.size_kv_pool(alloc.num_blocks, engine.backend.block_bytes, samples)
    old = alloc.num_blocks
    plan = engine.resize_kv_pool(target)
    policy.observe_pool(old, plan.num_blocks if plan else old)
    log.info("KV pool sized by the controller: %s", policy.pool.sizing)
    return alloc.num_blocks
