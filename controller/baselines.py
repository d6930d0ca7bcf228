"""The static baselines the controller must beat."""

from __future__ import annotations

from dataclasses import replace

from controller.limits import UNLIMITED, Limits
from controller.policy import StaticPolicy

# The seed engine's original scheduler: one global cap, prefill whenever requests wait, an unlimited token
# budget, whole-request KV reservation, prefill and decode never in one step. Its admission sizes a request
# as floor(tokens / block) + 1 blocks (one slot past input + max_tokens): the mechanism docs/twin.md found
# behind the twin running 11-14 % too fast where input + output is a multiple of 256 and KV binds.
SEED_ORIGINAL = Limits(
    max_num_seqs=64,
    kv_reserve_ratio=1.0,
    kv_reserve_extra_tokens=1,
    allow_mixed=False,
    prefill_first=True,
    chunked_prefill=False,
)


class FixedPolicy(StaticPolicy):
    """Plain caps from config or CLI on top of the seed's original scheduler. Setting a token budget turns
    chunked prefill on, since a prompt over the budget could otherwise never run."""

    name = "fixed"

    def __init__(self, **caps: float | bool) -> None:
        budgeted = (
            caps.get("max_prefill_tokens", UNLIMITED) < UNLIMITED
            or caps.get("max_batched_tokens", UNLIMITED) < UNLIMITED
        )
        caps.setdefault("chunked_prefill", budgeted)
        super().__init__(replace(SEED_ORIGINAL, **caps))


class VllmPolicy(StaticPolicy):
    """vLLM v1's scheduler as the held-out vLLM 0.19 run configured it, so a trace can replay under vLLM's
    rules and under the controller on the same twin: max_num_seqs 256, max_num_batched_tokens 2048, chunked
    prefill with running requests (decodes) first and prompt chunks filling the rest of the token budget
    (so at most one prefill is partial), FCFS, KV blocks allocated as tokens arrive (no reservation) and
    preemption by recompute of the newest running request when decode runs out of them."""

    name = "vllm"

    def __init__(self) -> None:
        # Limits' defaults are vLLM's other rules already: mixed steps, decodes first, chunked prefill, no
        # reservation.
        super().__init__(Limits(max_num_seqs=256, max_batched_tokens=2048, preempt_newest=True))


class SeedStaticPolicy(StaticPolicy):
    """The seed's final hand-tuned policy (calibration README): PREFILL_BATCH_CAP=8, DECODE_BATCH_CAP=24,
    LONG_CONTEXT_THRESHOLD=4096, LONG_CONTEXT_MAX_BATCH=1, DECODE_FIRST_WHEN_RUNNING=1."""

    name = "seed-static"

    def __init__(self, decode_first: bool = True) -> None:
        super().__init__(
            replace(
                SEED_ORIGINAL,
                max_prefill_seqs=8,
                max_decode_seqs=24,
                long_prompt_threshold=4096,
                max_long_per_batch=1,
                defer_long_while_decoding=decode_first,
            )
        )
