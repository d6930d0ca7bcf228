"""A request as the scheduler sees it: tokens, progress, KV blocks and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's logprobs, from the model's log-softmax before temperature and penalties (vLLM's
    default "raw" logprobs)."""

    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # the request's top k (token id, logprob), best first
    rank: int | None = None  # the chosen token's rank in the vocabulary, where asked (prompt logprobs)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: tuple[int, ...]  # immutable, so a step's items share it instead of copying it
    params: SamplingParams
    max_tokens: int  # resolved: never past the model's context
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    # prefix caching (engine/core/kv/prefix_cache.py): hashes of the full blocks of its tokens so far, and how many
    # blocks at the head of block_table are registered in the cache (or were hits)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Preempted by swap: the tokens whose KV went to host memory (the backend keeps the copy, by request id).
    swapped_tokens: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to output_ids when asked for
    # params.prompt_logprobs set: prompt_logprobs[p] is prompt token p's (None for the first), filled as the
    # prompt's chunks are computed (engine/core/llm_engine.py)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, tuple):
            self.prompt_ids = tuple(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """A new list of every token: O(length). A step's feed takes `token_slice` instead."""
        return [*self.prompt_ids, *self.output_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building token_ids: a decode step's one token costs O(1), not a
        copy of the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return list(self.prompt_ids[start:end])
        return [*self.prompt_ids[start:], *self.output_ids[: end - n]]

    def record_prompt_logprobs(self, first: int, scored: list[TokenLogprob]) -> None:
        """Take a step's prompt logprobs, `scored[i]` for prompt position `first + i`: those this sequence does not
        hold yet (a recompute after a preemption scores its prompt again)."""
        have = len(self.prompt_logprobs)
        if first <= have:
            self.prompt_logprobs.extend(scored[have - first :])

    @property
    def is_decode(self) -> bool:
        """True when only the last sampled token is missing from KV; otherwise the sequence prefills
        (its prompt, or prompt and output again after preemption by recompute)."""
        n_out = len(self.output_ids)  # num_tokens written out: the scheduler asks this of every sequence each step
        return n_out > 0 and len(self.prompt_ids) + n_out - self.num_computed == 1

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
