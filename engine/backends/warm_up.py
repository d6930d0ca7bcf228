"""The warm-up a backend runs before serving: a short prefill and one decode step through its own execute, so
the first request does not pay for OpenMP's thread team, the first touch of a step's buffers, or lazy kernel
loads. Its batches are plain data built here (no Sequence, no allocator: nothing of an engine's)."""

from __future__ import annotations

import time

from engine.core.backend import Backend
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.sampling_params import SamplingParams

WARM_UP_TOKENS = 128  # the warm-up prefill: a short prompt's size
WARM_UP_PARAMS = SamplingParams(temperature=0, max_tokens=1)


def run_warm_up(backend: Backend) -> float:
    """A prefill of up to WARM_UP_TOKENS tokens and one decode step, into the pool's first blocks before any
    request holds them; returns the seconds. Run on the thread that will run the steps (OpenMP starts a thread
    team per calling thread)."""
    tokens = min(WARM_UP_TOKENS, backend.max_model_len - 2)
    prompt = tuple(i % backend.vocab_size for i in range(tokens))
    table = list(range(-(-(tokens + 1) // backend.block_size)))
    start = time.perf_counter()
    sampled = backend.execute(_step(prompt, list(prompt), 0, table)).sampled
    backend.execute(_step(prompt, sampled, tokens, table))
    return time.perf_counter() - start


def _step(prompt: tuple[int, ...], token_ids: list[int], start: int, table: list[int]) -> SchedulerOutput:
    """The step that computes `token_ids` at `start` and samples the token after them."""
    batch = SchedulerOutput()
    n = len(token_ids)
    batch.add(ScheduledItem("warm-up", token_ids, start, n, n > 1, True, table, WARM_UP_PARAMS, prompt, 2))
    return batch
