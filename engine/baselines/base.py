"""What every baseline shares: static limits, and a worker that dies on an OOM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.policy import StaticPolicy
from engine.core.outputs import EngineOutput
from engine.core.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine


class BaselinePolicy(StaticPolicy):
    """A static policy with the engine-side rules of the engine it replays. LLMEngine reads two hooks:
    `scheduler_class`, the Scheduler (sub)class to pack steps with, and `on_oom(engine)`, run instead of the
    production recovery when a step runs out of memory."""

    scheduler_class: type[Scheduler] = Scheduler

    def on_oom(self, engine: LLMEngine) -> list[EngineOutput]:
        """The seed engine's and vLLM's worker dies: the engine stops, every request fails, and new ones are
        refused (EngineDeadError)."""
        engine.healthy = False
        failed = [*engine.scheduler.running, *engine.scheduler.waiting]
        for seq in failed:
            engine.abort(seq.request_id, "error")
        return [EngineOutput(seq.request_id, [], finish_reason="error") for seq in failed]
