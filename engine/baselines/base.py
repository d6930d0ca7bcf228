"""What every baseline shares: static limits, and a worker that dies on an OOM."""

from __future__ import annotations

from typing import ClassVar

from controller.policy import OomDecision, StaticPolicy
from engine.core.scheduler import Scheduler

WORKER_DIED = OomDecision(stop="a step ran out of memory and the worker died, as the seed engine's and vLLM's do")


class BaselinePolicy(StaticPolicy):
    """A static policy with the engine-side rules of the engine it replays: `scheduler_class`, the Scheduler
    (sub)class to pack steps with, and on an OOM the engine stops: every request fails, and new ones are refused
    (EngineDeadError)."""

    scheduler_class: ClassVar[type[Scheduler]] = Scheduler

    def on_oom(self) -> OomDecision:
        return WORKER_DIED
