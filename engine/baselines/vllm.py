"""vLLM v1's scheduler as the held-out vLLM 0.19 run configured it, so a trace can replay under vLLM's rules and
under the controller on the same twin."""

from __future__ import annotations

from controller.limits import Limits
from engine.baselines.base import BaselinePolicy
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence


class VllmScheduler(Scheduler):
    """The production rules but vLLM's preemption victim: the newest running request (`running.pop()`)."""

    def _victim(self, unscheduled: list[Sequence]) -> Sequence | None:
        return unscheduled[0] if unscheduled else None


class VllmPolicy(BaselinePolicy):
    """max_num_seqs 256, max_num_batched_tokens 2048, chunked prefill with running requests (decodes) first and
    prompt chunks filling the rest of the token budget (so at most one prefill is partial), FCFS, KV blocks
    allocated as tokens arrive (no reservation) and preemption by recompute of the newest running request when
    decode runs out of them."""

    name = "vllm"
    scheduler_class = VllmScheduler

    def __init__(self) -> None:
        # Limits' defaults are vLLM's other rules already: chunked prefill, no reservation.
        super().__init__(Limits(max_num_seqs=256, max_batched_tokens=2048))
