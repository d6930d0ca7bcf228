"""Everything that crosses between the engine thread and the event loop, typed: the counters the engine
thread publishes (`EngineSnapshot`), the facts fixed at start (`EngineInfo`), what a fleet router reads
(`PrefillLoad`), and each request's `RequestOutput` (engine/frontend/output_processor.py). Routes read the
engine through these and AsyncEngine's typed queries only, never the engine's own objects."""

from __future__ import annotations

from dataclasses import dataclass

from controller.limits import UNLIMITED
from engine.core.llm_engine import LLMEngine
from engine.core.stats import EngineStats
from engine.frontend.output_processor import LogprobEntry, RequestOutput
from telemetry.controller_stats import ControllerStats

__all__ = ["ControllerStats", "EngineInfo", "EngineSnapshot", "LogprobEntry", "PrefillLoad", "RequestOutput"]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's counters as the engine thread last published them: safe to read from any thread."""

    stats: EngineStats  # the engine's own (its waiting queue: adds still in the command queue are apart)
    num_requests: int  # accepted by the server and not yet finished

    @classmethod
    def of(cls, engine: LLMEngine, num_requests: int) -> EngineSnapshot:
        """Read on the engine thread (or before it starts)."""
        return cls(engine.stats(), num_requests)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What never changes while the server runs: /version and /v1/models."""

    model_root: str  # the model the backend loaded (or the twin's profile)
    max_model_len: int
    backend: str
    policy: str | None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        backend = engine.backend
        return cls(backend.model_name, engine.max_model_len, type(backend).__name__, engine.policy.name)


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """What a fleet's headroom router routes by (engine/serving/ray_serve/)."""

    effective_prefill_tokens: int  # the prompt tokens the next step admits
    queued_prefill_tokens: int  # prompt tokens waiting or running still to prefill

    @classmethod
    def of(cls, engine: LLMEngine) -> PrefillLoad:
        """Read on the engine thread."""
        step_tokens = engine.policy.stats().effective_prefill_tokens
        if step_tokens is None:  # a static policy: its cap is what a step admits
            step_tokens = engine.policy.limits().max_prefill_tokens
        sched = engine.scheduler
        queued = sum(max(0, seq.prompt_len - seq.num_computed) for seq in [*sched.waiting, *sched.running])
        return cls(min(step_tokens, UNLIMITED), queued)
