"""The interface between the engine and whatever decides its limits: before each step the policy publishes a
StepBudget (its limits and pure fit functions, controller/step_budget.py); after it, observe() reads the step's
record and what the fit functions cut.

Everything the engine asks of a policy is declared here, so the engine never probes a policy for optional
attributes, and every answer is a value: a pool decision (PoolTarget) is handed whole to the engine, and back
to the policy with what came of it (PoolResize), so no part of it waits in the policy for a later call; an OOM
decision (OomDecision) is applied by the engine, never by the policy reaching into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from controller.limits import Limits
from controller.step_budget import NO_CUTS, MemoryCuts, StepBudget
from telemetry.controller_stats import ControllerStats
from telemetry.record import MemorySample, StepRecord


@dataclass(frozen=True, slots=True)
class PoolProfile:
    """The start-up profiling steps a policy sizes the KV pool from (engine/core/kv/sizing.py runs them): a
    prefill of `prefill_tokens` prompt tokens, twice, then a decode of `decode_rows` sequences."""

    prefill_tokens: int
    decode_rows: int


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """One pool decision, whole. `num_blocks`: the size to resize to, giving back free blocks only (the engine
    never goes below the blocks in use nor below its largest admitted request). `must_reach`: where not None,
    the size the pool must reach even below the blocks in use, by preempting running sequences newest first
    (the last resort: the steps would otherwise run out of memory)."""

    num_blocks: int
    reason: str
    must_reach: int | None = None


@dataclass(frozen=True, slots=True)
class PoolResize:
    """What the engine made of a PoolTarget: the pool went from `old` to `new` blocks (`error`: the backend
    could not resize, and `new` is `old`), after preempting `preempted` running sequences."""

    target: PoolTarget
    old: int
    new: int
    error: str | None = None
    preempted: int = 0

    @property
    def changed(self) -> bool:
        return self.error is None and self.new != self.old


@dataclass(frozen=True, slots=True)
class OomDecision:
    """What the engine does after a step ran out of memory: `stop` None runs the step's work again under the
    limits observe() backs off (no request is lost); a reason stops the engine, failing every request and
    refusing new ones, as an engine whose worker dies on an OOM does."""

    stop: str | None = None


RECOVER = OomDecision()


class Policy(Protocol):
    name: str
    # The Scheduler subclass that packs the steps (a baseline's engine rules, engine/baselines/); None: the
    # engine's own Scheduler, which the controller cannot name.
    scheduler_class: ClassVar[type | None] = None
    # Whether the budget never moves and `observe` learns nothing: then steps whose schedule cannot change may
    # run back to back without either (the engine's decode burst, for the benchmarks' virtual time).
    feedback_free: ClassVar[bool] = False

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

    def on_oom(self) -> OomDecision:
        """A step ran out of memory: recover (the default) or stop the engine. observe() then gets the step's
        record either way."""
        return RECOVER

    def kv_pool_profile(self) -> PoolProfile | None:
        """The profiling steps this policy sizes the KV pool from at start-up; None: it never sizes the pool."""
        ...

    def kv_pool_start(self, num_blocks: int, block_bytes: int, samples: list[MemorySample]) -> PoolTarget:
        """Take over the pool: `samples` are what the kv_pool_profile() steps measured with `num_blocks` blocks
        of `block_bytes`. Returns the size to start with; the engine reports the resize to observe_pool."""
        ...

    def kv_pool_target(self, memory: MemorySample) -> PoolTarget | None:
        """Before each step: the pool decision to carry out now, or None to keep the pool (always None unless
        the policy sizes the pool). `memory` is the probe's latest sample."""
        ...

    def observe_pool(self, resize: PoolResize) -> None:
        """What came of a PoolTarget (kv_pool_start's or kv_pool_target's)."""
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


class StaticPolicy(Policy):
    """Base for policies whose limits never move: everything fits that the limits allow, and the pool stays
    the size it was built with."""

    name = "static"
    feedback_free = True  # a subclass that overrides observe or step_budget says False

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

    def kv_pool_profile(self) -> PoolProfile | None:
        return None

    def kv_pool_start(self, num_blocks: int, block_bytes: int, samples: list[MemorySample]) -> PoolTarget:
        return PoolTarget(num_blocks, f"policy {self.name!r} keeps the pool it starts with")

    def kv_pool_target(self, memory: MemorySample) -> PoolTarget | None:
        return None

    def observe_pool(self, resize: PoolResize) -> None:
        return None

    def state(self) -> dict:
        return {"policy": self.name, "limits": self._limits.as_dict()}

    def stats(self) -> ControllerStats:
        return ControllerStats()

    def update_config(self, patch: dict) -> None:
        raise ValueError(f"policy {self.name!r} has no runtime config; start with --policy adaptive")
