"""A decode burst: a run of identical decode-only steps advanced without the scheduler, for the benchmarks' load
generators in virtual time (bench/loadgen.py), where a single 4096-token output is 4096 steps.

Why it is exact: it runs only when nothing can change the schedule -- a policy whose feedback is a no-op and
whose budget never moves, no request added or aborted since the last step, nobody listening to step records, no
preemption, no prefill, requests that only their length ends (EOS ignored, no stop strings or stop token ids) and
that asked for no logprobs, KV blocks to spare for every step -- and stops one step short of the first request's
last token, whose step (and its finish) is the engine's. Each step is the backend's own (Backend.decode_step: the
twin models it as execute() would); only schedule(), which would return the same batch, and the no-op feedback are
skipped. tests/test_twin_latency.py checks that results are identical with and without it.
"""

from __future__ import annotations

from engine.core.backend import Backend
from engine.core.batch import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, Status


def burst_sequences(batch: SchedulerOutput, scheduler: Scheduler) -> list[Sequence] | None:
    """The sequences of `batch`, the last step's, when its steps can repeat without the scheduler; else None."""
    if batch.preempted or any(it.is_prefill for it in batch.items):
        return None
    seqs = []
    for item in batch.items:
        seq = scheduler.requests.get(item.request_id)
        if seq is None or seq.status is not Status.RUNNING or not _runs_to_length(seq):
            return None
        seqs.append(seq)
    return None if any(not s.is_decode for s in scheduler.running) else seqs


def _runs_to_length(seq: Sequence) -> bool:
    """Whether only its length can end it, and its tokens alone are its output: no EOS, stop token ids, stop
    strings or logprobs to check or keep."""
    params = seq.params
    return params.ignore_eos and not params.stop_token_ids and not params.stop and params.logprobs is None


def run_burst(seqs: list[Sequence], scheduler: Scheduler, backend: Backend, until: float) -> int:
    """Up to one step short of the first finish, while the backend runs each (Backend.decode_step), starting
    before `until`; returns the steps run. Each step's bookkeeping is the scheduler's and the step loop's: a KV
    slot where the last block is full (the scheduler's _grow_for_decode), the position computed, the token
    appended with its time."""
    steps = min(s.max_tokens - len(s.output_ids) for s in seqs) - 1
    alloc = scheduler.allocator
    if steps <= 0:
        return 0
    grow = sum(max(0, alloc.blocks_for(s.num_tokens + steps - 1) - len(s.block_table)) for s in seqs)
    if grow > alloc.num_free:
        return 0
    block_size, done = alloc.block_size, 0
    for _ in range(steps):
        positions = [s.num_computed for s in seqs]  # the KV slot each writes this step
        tokens = backend.decode_step(positions, until)
        if tokens is None:
            break
        now = backend.now()
        for s, pos, token in zip(seqs, positions, tokens, strict=True):
            if pos >= len(s.block_table) * block_size:
                alloc.allocate_slots(s, 1)
            s.num_computed = pos + 1
            s.output_ids.append(token)
            s.token_times.append(now)
        done += 1
    return done
