"""What the engine hands the outside as frozen data (as vLLM's SchedulerStats): `EngineStats`, its counters
and gauges now, and `FinishedRequest`, a request as it left the engine. Listeners, the server and the
benchmarks read these, never the scheduler's sequences or the allocator, so none can change what the core keeps
consistent, nor keep a request's state alive."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sequence import Sequence, TokenLogprob


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine between two steps (LLMEngine.stats)."""

    healthy: bool
    steps: int  # steps run, a decode burst's included
    ooms: int
    ooms_recovered: int
    preemptions: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    max_model_len: int
    prefix_cache_queries: int  # tokens of admitted requests (0 with prefix caching off)
    prefix_cache_hits: int  # of those, tokens whose KV came from the prefix cache


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request as it left the engine, what its finish listeners receive: its tokens, its timestamps (wall or
    virtual seconds, the backend's clock) and why it ended ("stop", "length", "abort", "error")."""

    request_id: str
    prompt_len: int
    max_tokens: int
    output_ids: tuple[int, ...]
    output_logprobs: tuple[TokenLogprob, ...]  # parallel to output_ids when the request asked for logprobs
    finish_reason: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: tuple[float, ...]
    num_preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> FinishedRequest:
        return cls(
            seq.request_id,
            seq.prompt_len,
            seq.max_tokens,
            tuple(seq.output_ids),
            tuple(seq.output_logprobs),
            seq.finish_reason or "abort",
            seq.arrival_time,
            seq.first_scheduled_time,
            seq.first_token_time,
            tuple(seq.token_times),
            seq.num_preemptions,
        )
