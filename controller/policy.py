"""The interface between the scheduler (engine) and whatever decides its limits: before each step the policy
publishes a StepBudget (its limits and pure fit functions, controller/step_budget.py); after it, observe() reads
the step's record and what the fit functions cut."""

from __future__ import annotations

from typing import Protocol

from controller.limits import Limits
from controller.step_budget import NO_CUTS, MemoryCuts, StepBudget
from telemetry.controller_stats import ControllerStats
from telemetry.record import MemorySample, StepRecord


class Policy(Protocol):
    name: str

    def limits(self) -> Limits:
        """The limits of the next step (the budget's); the step's record carries them."""
        ...

    def step_budget(self) -> StepBudget:
        """The next step's budget; called once at the start of every schedule. Its fit functions change
        nothing, so the scheduler may call them as often as it packs."""
        ...

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request can never be served (checked at arrival), or None."""
        ...

    def observe_finished(self, output_len: int, max_tokens: int, reason: str) -> None:
        """A request left the engine after `output_len` of its `max_tokens` ("stop", "length", "abort",
        "error"): real output lengths can teach the KV reservation."""
        ...

    def observe(self, record: StepRecord, cuts: MemoryCuts = NO_CUTS) -> None:
        """Feed back what the step really used and what memory cut while it was packed (the scheduler's
        output carries the cuts); called after every step, OOM steps included."""
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

    def stats(self) -> ControllerStats:
        """The counts and gauges metrics export (telemetry/controller_stats.py)."""
        ...

    def update_config(self, patch: dict) -> None:
        """Apply runtime config changes atomically; ValueError (and no change) on bad values."""
        ...


class StaticPolicy:
    """Base for policies whose limits never move: everything fits that the limits allow."""

    name = "static"

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._budget = StepBudget(limits)

    def limits(self) -> Limits:
        return self._limits

    def step_budget(self) -> StepBudget:
        return self._budget

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        return None

    def observe(self, record: StepRecord, cuts: MemoryCuts = NO_CUTS) -> None:
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

    def stats(self) -> ControllerStats:
        return ControllerStats()

    def update_config(self, patch: dict) -> None:
        raise ValueError(f"policy {self.name!r} has no runtime config; start with --policy adaptive")
