"""The seed engine (calibration README), the baseline the controller must beat: its scheduling rules, its caps,
and its worker that dies on an OOM (engine/baselines/base.py).

Its original scheduler: one global cap, prefill whenever requests wait, an unlimited token budget, whole-request
KV reservation, prefill and decode never in one step. Its admission sizes a request as floor(tokens / block) + 1
blocks (one slot past input + max_tokens): docs/twin.md shows how the twin's throughput depends on it where
input + output is a multiple of 256 and KV binds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from controller.limits import UNLIMITED, Limits
from controller.step_budget import Packer
from engine.baselines.base import BaselinePolicy
from engine.core.batch import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence


@dataclass(frozen=True)
class SeedRules:
    """The seed's scheduling rules beyond Limits."""

    prefill_first: bool = True  # when a prefill can be scheduled, the step is prefill-only
    allow_mixed: bool = False  # prefill and decode may share a step
    # Prompts of at least `long_prompt_threshold` tokens are at most `max_long_per_batch` per step (decodes
    # included), and wait while any sequence decodes if `defer_long_while_decoding`.
    long_prompt_threshold: int = UNLIMITED
    max_long_per_batch: int = UNLIMITED
    defer_long_while_decoding: bool = False
    # Token slots reserved at admission beyond the request's tokens and its reserved output: one slot more
    # than it can write.
    kv_reserve_extra_tokens: int = 1


SEED_LIMITS = Limits(max_num_seqs=64, kv_reserve_ratio=1.0, chunked_prefill=False)
RULE_NAMES = {f.name for f in fields(SeedRules)}
CONFIG_NAMES = {"max_num_batched_tokens": "max_batched_tokens"}  # EngineConfig -> here
# EngineConfig.fixed_steps: "seed" packs as the seed engine did, "mixed" puts decodes first and lets prompt chunks
# fill the rest of the step, as vLLM v1 (and the adaptive policy) do.
FIXED_STEPS = {"seed": {}, "mixed": {"prefill_first": False, "allow_mixed": True}}


class SeedScheduler(Scheduler):
    """The production scheduler under the seed's rules (its policy's `rules`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rules: SeedRules = self.policy.rules  # type: ignore[attr-defined]

    def _fill(self, lim: Limits, packer: Packer, out: SchedulerOutput) -> None:
        first, then = self._schedule_decodes, self._schedule_prefills
        if self.rules.prefill_first:
            first, then = then, first
        first(lim, packer, out)
        if self.rules.allow_mixed or not out.items:
            then(lim, packer, out)

    def _long_in(self, out: SchedulerOutput) -> int:
        return sum(len(it.prompt_ids) >= self.rules.long_prompt_threshold for it in out.items)

    def _decodable(self, lim: Limits, out: SchedulerOutput, scheduled: set[str]) -> Iterator[Sequence]:
        r = self.rules
        long_in_batch = self._long_in(out)
        for seq in super()._decodable(lim, out, scheduled):
            if seq.prompt_len >= r.long_prompt_threshold:
                if long_in_batch >= r.max_long_per_batch:
                    continue
                long_in_batch += 1
            yield seq

    def _prefill_waits(self, seq: Sequence, out: SchedulerOutput) -> bool:
        r = self.rules
        if seq.prompt_len < r.long_prompt_threshold:
            return False
        decoding = r.defer_long_while_decoding and any(s.is_decode for s in self.running)
        return decoding or self._long_in(out) >= r.max_long_per_batch

    @property
    def reserve_slack(self) -> int:
        return self.rules.kv_reserve_extra_tokens

    def _future_tokens(self, seq: Sequence, lim: Limits) -> int:
        return super()._future_tokens(seq, lim) + self.reserve_slack


class SeedPolicy(BaselinePolicy):
    """Limits and SeedRules, packed by SeedScheduler."""

    scheduler_class = SeedScheduler

    def __init__(self, limits: Limits, rules: SeedRules) -> None:
        super().__init__(limits)
        self.rules = rules


class FixedPolicy(SeedPolicy):
    """Plain caps from config or CLI (Limits fields and SeedRules fields, by name) on top of the seed's original
    scheduler. Setting a token budget turns chunked prefill on, since a prompt over the budget could otherwise
    never run."""

    name = "fixed"

    def __init__(self, **caps: float | bool) -> None:
        budgeted = (
            caps.get("max_prefill_tokens", UNLIMITED) < UNLIMITED
            or caps.get("max_batched_tokens", UNLIMITED) < UNLIMITED
        )
        caps.setdefault("chunked_prefill", budgeted)
        rules = {k: v for k, v in caps.items() if k in RULE_NAMES}
        limits = {k: v for k, v in caps.items() if k not in RULE_NAMES}
        super().__init__(replace(SEED_LIMITS, **limits), SeedRules(**rules))  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, caps: dict[str, Any]) -> FixedPolicy:
        """From EngineConfig.fixed_caps(), whose names follow the CLI flags."""
        steps = FIXED_STEPS[caps.pop("fixed_steps", None) or "seed"]
        return cls(**steps, **{CONFIG_NAMES.get(k, k): v for k, v in caps.items()})


class SeedStaticPolicy(SeedPolicy):
    """The seed's final hand-tuned policy (calibration README): PREFILL_BATCH_CAP=8, DECODE_BATCH_CAP=24,
    LONG_CONTEXT_THRESHOLD=4096, LONG_CONTEXT_MAX_BATCH=1, DECODE_FIRST_WHEN_RUNNING=1."""

    name = "seed-static"

    def __init__(self, decode_first: bool = True) -> None:
        super().__init__(
            replace(SEED_LIMITS, max_prefill_seqs=8, max_decode_seqs=24),
            SeedRules(long_prompt_threshold=4096, max_long_per_batch=1, defer_long_while_decoding=decode_first),
        )
