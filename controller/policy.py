"""The interface between the scheduler (engine) and whatever decides its limits."""

from __future__ import annotations

from typing import Protocol

from controller.limits import Limits
from telemetry.record import MemorySample, StepRecord, StepShape


class Policy(Protocol):
    name: str
    # True: an OOM in a step is recovered (work requeued, engine healthy). False: the baseline
    # behaviour of the seed engine, whose worker dies and fails the step's requests.
    recovers_oom: bool

    def limits(self) -> Limits:
        """Limits for the next step; called once at the start of every schedule."""
        ...

    def fit_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        """Largest prefill chunk (<= chunk) that fits beside the step already packed in `shape`, for a
        sequence with `context` tokens already in KV. 0 defers it to a later step."""
        ...

    def fit_decodes(self, shape: StepShape, contexts: list[int]) -> int:
        """How many of these decode candidates (their contexts, in the scheduler's order) fit beside
        `shape`. One call per step: a call per sequence would cost more than the rest of the decision."""
        ...

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request can never be served (checked at arrival), or None."""
        ...

    def observe_finished(self, output_len: int, max_tokens: int, reason: str) -> None:
        """A request left the engine after `output_len` of its `max_tokens` ("stop", "length", "abort",
        "error"): real output lengths can teach the KV reservation."""
        ...

    def observe(self, record: StepRecord) -> None:
        """Feed back what the step really used; called after every step, OOM steps included."""
        ...

    def kv_pool_target(self, memory: MemorySample) -> int | None:
        """Before each step: the KV pool size to resize to now, or None to keep it (always None unless the
        policy sizes the pool). `memory` is the probe's latest sample."""
        ...

    def kv_pool_preempt_target(self) -> int | None:
        """After kv_pool_target asked for a shrink: the pool size to reach even below the blocks in use, by
        preempting running sequences (the last resort), or None to give back free blocks only."""
        ...

    def observe_pool(self, old: int, new: int, error: str | None = None, preempted: int = 0) -> None:
        """The engine resized the pool from `old` to `new` blocks, or could not (`error`); `preempted`
        running sequences were preempted first because the target was below the blocks in use."""
        ...

    def state(self) -> dict:
        """JSON-able view for GET /controller/state: at least `policy` and `limits`."""
        ...

    def update_config(self, patch: dict) -> None:
        """Apply runtime config changes atomically; ValueError (and no change) on bad values."""
        ...


class StaticPolicy:
    """Base for policies whose limits never move: everything fits that the limits allow."""

    name = "static"
    recovers_oom = False

    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def limits(self) -> Limits:
        return self._limits

    def fit_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        return chunk

    def fit_decodes(self, shape: StepShape, contexts: list[int]) -> int:
        return len(contexts)

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        return None

    def observe(self, record: StepRecord) -> None:
        return None

    def observe_finished(self, output_len: int, max_tokens: int, reason: str) -> None:
        return None

    def kv_pool_target(self, memory: MemorySample) -> int | None:
        return None

    def kv_pool_preempt_target(self) -> int | None:
        return None

    def observe_pool(self, old: int, new: int, error: str | None = None, preempted: int = 0) -> None:
        return None

    def state(self) -> dict:
        return {"policy": self.name, "limits": self._limits.as_dict()}

    def update_config(self, patch: dict) -> None:
        raise ValueError(f"policy {self.name!r} has no runtime config; start with --policy adaptive")
