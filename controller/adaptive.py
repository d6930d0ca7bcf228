"""AdaptivePolicy: the memory-feedback controller behind the engine's Policy protocol (controller/policy.py).

Each step: the scheduler takes `step_budget()`, the step's limits (rebuilt only when a cap or the KV ratio moves)
and its pure fit functions (a few multiply-adds against thresholds precomputed once per step,
controller/admission.py); the engine then reports the step's record and what the fit functions cut
(controller/step_budget.py) to `observe()`. The policy composes one part per concept, each with its own state:
- `memory` (controller/memory_model.py): the step-peak and retained-memory estimators and the budget, learnt
  from the record; the thresholds and fit functions that say what the next step may pack;
- `law` (controller/law.py): the budget's scale and the batch caps, moved by the measured error;
- `kv` (controller/kv_reservation.py): the KV reservation ratio, from preemptions and finished requests;
- `pool` (controller/pool_rules.py): the KV pool's size, over the same budget;
and reports them: `counters` (controller/counters.py), the decision log (controller/decisions.py: the parts
return their decisions as values, logged here with the step), `state()` for GET /controller/state and `stats()`
for metrics. `update_config()` patches gains atomically at run time.

Not thread-safe, by design: the engine thread owns the policy, and the server reaches it through the
engine's command queue (engine/serving/async_engine.py), so no call here needs a lock.
"""

from __future__ import annotations

from typing import Any

from controller.config import ControllerConfig
from controller.counters import Counters
from controller.decisions import DECISIONS_KEPT, Reason, export, log_decision, new_log
from controller.kv_reservation import KVReservation
from controller.law import ControlLaw
from controller.limits import UNLIMITED, Limits
from controller.memory_model import Learnt, MemoryModel
from controller.policy import Policy, PoolProfile, PoolResize, PoolTarget
from controller.pool_rules import PoolSizer
from controller.step_budget import NO_CUTS, MemoryCuts, StepBudget
from controller.tightest_rank import ranks_state
from telemetry.controller_stats import ControllerStats
from telemetry.record import MemorySample, RankSample, StepRecord
from telemetry.units import MIB

__all__ = ["DECISIONS_KEPT", "AdaptivePolicy"]


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.cfg = c = config or ControllerConfig()
        self.memory = MemoryModel(c)
        self.law = ControlLaw(c)
        self.kv = KVReservation(c)
        self.pool = PoolSizer(c, self.memory.budget)
        self.counters = Counters()
        self.decisions = new_log()
        self._step = 0
        self._ranks: list[RankSample] = []  # tensor parallel: every rank's sample of the last step
        self._budget: StepBudget | None = None  # the next step's, made when first asked for
        self._limits_key: tuple | None = None
        self._limits = Limits()
        self.memory.refresh(self.law.scale)
        self._refresh_limits()

    # --- Policy protocol: the steps -------------------------------------------------------------------
    def limits(self) -> Limits:
        return self._limits

    def step_budget(self) -> StepBudget:
        """The next step's limits and memory checks, frozen: the fit functions read a snapshot of the
        coefficients and thresholds, so they change nothing and nothing after this call changes them."""
        if self._budget is None:
            fit = self.memory.memory_fit()
            self._budget = StepBudget(self._limits, fit.fit_chunk, fit.fit_decodes, self.cfg.min_chunk)
        return self._budget

    def effective_prefill_tokens(self) -> int:
        """The prefill limit that binds now: the prompt tokens the next step could take when it carries
        nothing else (fresh prompts), the smaller of the cap and what memory admits."""
        return self.memory.largest_prefill(self.law.prefill_cap)

    def memory_decode_seqs(self, context: int) -> int:
        """Decodes of `context` tokens that memory alone admits into an empty step (up to the
        max_decode_seqs ceiling; the trust-region cap is not applied)."""
        return self.memory.decodes_that_fit(context)

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Only certain failures (MemoryModel.never_fits). A request that does not fit only because of memory
        held elsewhere waits in the queue: a 400 is final, and the shortage passes (the serving layer's queue
        limits and timeouts still apply)."""
        reason = self.memory.never_fits(prompt_len, max_tokens)
        if reason is not None:
            self.counters.rejected_too_long += 1
            self._log("reject", reason)
        return reason

    def observe(self, record: StepRecord, cuts: MemoryCuts = NO_CUTS) -> None:
        """After every step (OOM steps included): what the step used, and what memory cut while packing it."""
        self._step = record.step_id
        self._ranks = record.ranks
        self.counters.steps += 1
        learnt = self.memory.learn(record)
        if learnt.reset is not None:
            self.counters.estimator_resets += 1
            self._log("estimator_reset", learnt.reset)
        self._feedback(record, cuts, learnt)
        self.memory.refresh(self.law.scale)
        self._refresh_limits()
        self._budget = None

    def observe_finished(self, output_len: int, max_tokens: int, reason: str) -> None:
        """A request finished; its output length teaches the KV reservation (aborts and errors do not)."""
        if reason in ("stop", "length"):
            self.kv.observe_finished(output_len, max_tokens)

    # --- Policy protocol: the KV pool (controller/pool_rules.py decides; the engine resizes) ----------
    def kv_pool_profile(self) -> PoolProfile:
        return self.pool.profile()

    def kv_pool_start(self, num_blocks: int, block_bytes: int, samples: list[MemorySample]) -> PoolTarget:
        target, decision = self.pool.size_at_start(num_blocks, block_bytes, samples)
        self._log(decision.action, decision.reason)
        return target

    def kv_pool_target(self, memory: MemorySample) -> PoolTarget | None:
        """Before a step is packed; `memory` is the probe's latest sample, so memory another process took
        since the last step counts."""
        if not self.pool.enabled:
            return None
        return self.pool.decide(self._step, self.pool.room(memory))

    def observe_pool(self, resize: PoolResize) -> None:
        self.counters.kv_pool_preemptions += resize.preempted
        for decision in self.pool.resized(self._step, resize):
            self._log(decision.action, decision.reason)
        if resize.changed:
            self.counters.kv_pool_resizes += 1
            self._thresholds_moved()

    # --- Policy protocol: reporting and config --------------------------------------------------------
    def state(self) -> dict[str, Any]:
        b = self.memory.budget.budget
        return {
            "policy": self.name,
            "step": self._step,
            "limits": self._limits.as_dict(),
            "effective_prefill_tokens": self.effective_prefill_tokens(),
            "budget": {**b.as_dict(), "scale": self.law.scale, "effective": int(self.law.scale * b.usable)},
            "estimator": self.memory.state(),
            "law": self.law.state(),
            "emergency": self.law.emergency,
            "kv_reservation": self.kv.state(),
            "kv_pool": self.pool.state(),
            "counters": self.counters.as_dict(),
            "ranks": ranks_state(self._ranks),
            "decisions": export(self.decisions),
            "config": self.cfg.as_dict(),
        }

    def stats(self) -> ControllerStats:
        c, memory = self.counters, self.memory
        return ControllerStats(
            backoffs=c.backoffs,
            deferrals=c.deferrals,
            chunks=c.chunks,
            ooms_recovered=c.ooms_recovered,
            rejected_too_long=c.rejected_too_long,
            kv_pool_resizes=c.kv_pool_resizes,
            budget_bytes=int(self.law.scale * memory.budget.budget.usable),
            predicted_peak_bytes=int(memory.last_prediction * MIB),
            margin_bytes=int(memory.estimator.margin_floor * MIB),
            emergency=self.law.emergency,
            kv_pool_bytes=self.pool.pool_bytes,
            effective_prefill_tokens=self.effective_prefill_tokens(),
        )

    def update_config(self, patch: dict[str, Any]) -> None:
        """Validate and apply gains at run time, all or nothing (ValueError names the bad gain)."""
        new = self.cfg.replace(patch)
        self.cfg = new
        self.memory.configure(new)
        self.law.configure(new)
        self.kv.configure(new)
        self.pool.configure(new)
        self._limits_key = None
        self._thresholds_moved()
        self._refresh_limits()
        self._log("config", "gains updated: " + ", ".join(f"{k}={v}" for k, v in sorted(patch.items())))

    # --- internals ------------------------------------------------------------------------------------
    def _feedback(self, rec: StepRecord, cuts: MemoryCuts, learnt: Learnt) -> None:
        """The control law, the KV reservation, the pool's demand and the counters, from one step."""
        counters, shape, law = self.counters, rec.shape, self.law
        if rec.oom:
            counters.ooms_recovered += 1
        peak, usable_now, retry = learnt.peak, learnt.usable_now, learnt.retry
        events = law.observe(
            rec.step_id, peak, usable_now, rec.oom, retry, shape.prefill_tokens, shape.decode_seqs, cuts.cut
        )
        if events:
            for e in events:
                self._log(e.action, e.reason)
            counters.backoffs = law.backoffs
        counters.preemptions += rec.preempted
        if why := self.kv.observe(rec.preempted, shape.decode_seqs):
            self._log("kv_ratio", why)
        packed = bool(cuts.chunks or cuts.deferred)
        if self.pool.enabled:
            spare = rec.kv_blocks_free - rec.kv_blocks_owed
            if why := self.pool.note_demand(rec.step_id, rec.preempted, packed, spare):
                self._log("kv_pool_demand", why)
        if packed:
            counters.chunks += cuts.chunks
            counters.deferrals += cuts.deferred
            self._log("pack", self._pack_reason(cuts), quiet=True)

    def _pack_reason(self, cuts: MemoryCuts) -> Reason:
        """Formatted when read: memory-bound serving logs this every step, each replacing the last, so formatting
        it every step would be work nobody reads."""
        chunks, defers, pred = cuts.chunks, cuts.deferred, self.memory.last_prediction
        threshold, scale = self.memory.prefill_threshold, self.law.scale
        return lambda: (
            f"{chunks} chunked, {defers} deferred: predicted {pred:.0f} MiB vs "
            f"threshold {threshold:.0f} MiB (scale {scale:.2f})"
        )

    def _thresholds_moved(self) -> None:
        """The budget changed outside a step (a pool resize, new gains): recompute the thresholds now."""
        self.memory.moved(self.law.scale)
        self._budget = None

    def _refresh_limits(self) -> None:
        law, c = self.law, self.cfg
        key = (law.prefill_cap, law.decode_cap, round(self.kv.ratio, 2), law.emergency)
        if key != self._limits_key:
            self._limits_key = key
            self._limits = Limits(
                max_prefill_tokens=law.prefill_cap,
                max_prefill_seqs=1 if law.emergency else c.max_prefill_seqs,
                max_decode_seqs=law.decode_cap,
                max_num_seqs=c.max_num_seqs,
                max_batched_tokens=UNLIMITED,
                kv_reserve_ratio=key[2],
                preempt_by_swap=c.kv_preempt_swap,
                chunked_prefill=True,
            )
            self._log(
                "limits",
                f"prefill_tokens={law.prefill_cap} decode_seqs={law.decode_cap} "
                f"kv_ratio={key[2]:.2f} emergency={law.emergency}",
                quiet=True,
            )

    def _log(self, action: str, reason: Reason, quiet: bool = False) -> None:
        log_decision(self.decisions, self._step, action, reason, quiet)
