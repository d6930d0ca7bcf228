"""AdaptivePolicy: the memory-feedback controller behind the scheduler's Policy protocol.

Each step: the scheduler takes `step_budget()`, the step's limits (rebuilt only when a cap or the KV ratio moves)
and its pure fit functions (a few multiply-adds against thresholds precomputed once per step,
controller/admission.py); the engine then reports the step's record and what the fit functions cut
(controller/step_budget.py) to `observe()`, which feeds
- the step-peak estimator (sampled records only; OOM steps as a lower bound),
- the retained-memory estimator (what a step leaves allocated into the next one, e.g. logits an engine
  keeps referenced: it is part of the next step's idle and unknown when that step is packed),
- the budget (capacity, memory outside the allocator and idle floor, as the probe saw them),
- the control law (budget scale and caps) and the KV reservation ratio,
and precomputes the next step's thresholds (see _refresh for the three checks on a prefill chunk).
`state()` is GET /controller/state; `update_config()` patches gains atomically at run time.
`observe_finished()` hands each finished request's output length to the KV reservation. The pool-sizing
methods are controller/pool_control.py's, the decision log controller/decisions.py's.

Not thread-safe, by design: the engine thread owns the policy, and the server reaches it through the
engine's command queue (engine/serving/async_engine.py), so no call here needs a lock.
"""

from __future__ import annotations

from typing import Any

from controller.admission import INF, MemoryFit, decodes_that_fit, thresholds
from controller.budget import MIB, BudgetTracker
from controller.config import ControllerConfig
from controller.decisions import DECISIONS_KEPT, Reason, export, log_decision, new_log
from controller.estimator import PeakEstimator, predict
from controller.kv_pool import PoolSizer
from controller.kv_reservation import KVReservation
from controller.law import ControlLaw
from controller.limits import UNLIMITED, Limits
from controller.pool_control import PoolControl
from controller.step_budget import NO_CUTS, MemoryCuts, StepBudget
from controller.tightest_rank import ranks_state, step_memory
from telemetry.controller_stats import ControllerStats
from telemetry.record import RankSample, StepRecord, StepShape

__all__ = ["DECISIONS_KEPT", "AdaptivePolicy"]
RETAINED_FEATURES = ("intercept", "prefill_tokens", "decode_seqs", "sampled_seqs")


class AdaptivePolicy(PoolControl):
    name = "adaptive"

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.cfg = config or ControllerConfig()
        c = self.cfg
        self.estimator = PeakEstimator(**self._estimator_gains(c))
        # bytes a step leaves allocated into the next one (see budget.py): outputs of the step, so the
        # rows it computes matter, not its context or attention
        self.retained = PeakEstimator(**self._estimator_gains(c), active=RETAINED_FEATURES)
        self.budget = BudgetTracker(c.headroom_frac, c.headroom_min_mib, c.use_device_used)
        self.law = ControlLaw(c)
        self.kv = KVReservation(c)
        self.pool = PoolSizer(c)
        self.counters = {
            "steps": 0,
            "backoffs": 0,
            "deferrals": 0,
            "chunks": 0,
            "preemptions": 0,
            "ooms_recovered": 0,
            "rejected_too_long": 0,
            "estimator_resets": 0,
            "kv_pool_resizes": 0,
            "kv_pool_preemptions": 0,
        }
        self.decisions = new_log()
        self._raw = self.estimator.raw  # live list, updated in place by the estimator
        self._t_prefill = INF
        self._t_decode = INF
        # "leave room for the successor": this step's peak plus what it retains into the next step must
        # fit the budget without the current step's predecessor (see _refresh)
        self._t_pair = INF
        self._t_worst = INF
        self._last_retries: int | None = None
        self._step = 0
        self._ranks: list[RankSample] = []  # tensor parallel: every rank's sample of the last step
        self._budget: StepBudget | None = None  # the next step's, made when first asked for
        self._limits_key: tuple | None = None
        self._limits = Limits()
        self._last_pred = 0.0
        self._last_peak: float | None = None
        self._prev: tuple[int, StepShape, bool] | None = None  # (step id, shape, oom) of the last sample
        self._retained_next = 0.0
        self._pool_reason = ""
        self._refresh_key: tuple | None = None
        self._refresh()
        self._refresh_limits()

    @staticmethod
    def _estimator_gains(c: ControllerConfig) -> dict[str, Any]:
        return {
            "forgetting": c.forgetting,
            "prior_variance": c.prior_variance,
            "margin_quantile": c.margin_quantile,
            "margin_window": c.margin_window,
            "margin_floor_mib": c.margin_floor_mib,
            "margin_cold": c.margin_cold,
            "change_threshold": c.change_threshold,
            "change_count": c.change_count,
        }

    # --- Policy protocol ------------------------------------------------------------------------------
    def limits(self) -> Limits:
        return self._limits

    def step_budget(self) -> StepBudget:
        """The next step's limits and memory checks, frozen: the fit functions read a snapshot of the
        coefficients and thresholds, so they change nothing and nothing after this call changes them."""
        if self._budget is None:
            fit = self._memory_fit()
            self._budget = StepBudget(self._limits, fit.fit_chunk, fit.fit_decodes, self.cfg.min_chunk)
        return self._budget

    def _memory_fit(self) -> MemoryFit:
        return MemoryFit(
            tuple(self._raw),
            tuple(self.retained.raw),
            self._t_prefill,
            self._t_decode,
            self._t_pair,
            self._t_worst,
            self.cfg.min_chunk,
        )

    def effective_prefill_tokens(self) -> int:
        """The prefill limit that binds now: the prompt tokens the next step could take when it carries
        nothing else (fresh prompts), the smaller of the cap and what memory admits."""
        return self._memory_fit().largest_chunk(StepShape(), 0, self.law.prefill_cap)

    def memory_decode_seqs(self, context: int) -> int:
        """Decodes of `context` tokens that memory alone admits into an empty step (up to the
        max_decode_seqs ceiling; the trust-region cap is not applied)."""
        return decodes_that_fit(self._raw, StepShape(), [context] * self.cfg.max_decode_seqs, self._t_decode)

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Only certain failures: with the model trained, even the smallest last chunk of the prompt, or
        the final decode of prompt + max_tokens, alone on a step, is predicted (without margin) to need
        more than all the memory above idle the device would have if other processes gave theirs back.
        A request that does not fit only because of memory held elsewhere waits in the queue: a 400 is final,
        and the shortage passes (the serving layer's queue limits and timeouts still apply)."""
        b = self.budget.budget
        if not b.known or not self.estimator.trained:
            return None
        free = (b.capacity - self.budget.external_floor - b.idle) / MIB  # what a step alone would ever have
        r = self._raw
        chunk = min(prompt_len, self.cfg.min_chunk)
        ctx = prompt_len - chunk
        s = StepShape(
            prefill_tokens=chunk,
            prefill_seqs=1,
            sum_context=prompt_len,
            max_context=prompt_len,
            prefill_attn=chunk * prompt_len,
            sampled_seqs=1,
        )
        need = predict(r, s)
        what = f"even a {chunk}-token chunk at position {ctx}"
        if need <= free:
            total = prompt_len + max_tokens
            s = StepShape(decode_seqs=1, sum_context=total, max_context=total, sampled_seqs=1)
            need = predict(r, s)
            what = f"a decode step at context {total}"
        if need <= free:
            return None
        self.counters["rejected_too_long"] += 1
        reason = (
            f"request cannot fit in device memory: {what} needs ~{need:.0f} MiB above idle, "
            f"only {free:.0f} MiB are free"
        )
        self._log("reject", reason)
        return reason

    def observe(self, record: StepRecord, cuts: MemoryCuts = NO_CUTS) -> None:
        """After every step (OOM steps included): what the step used, and what memory cut while packing it."""
        self._step = record.step_id
        self._ranks = record.ranks
        self.counters["steps"] += 1
        peak, usable_now, retry = self._learn(record)
        self._feedback(record, cuts, peak, usable_now, retry)
        self._refresh()
        self._refresh_limits()
        self._budget = None

    def observe_finished(self, output_len: int, max_tokens: int, reason: str) -> None:
        """A request finished; its output length teaches the KV reservation (aborts and errors do not)."""
        if reason in ("stop", "length"):
            self.kv.observe_finished(output_len, max_tokens)

    def state(self) -> dict[str, Any]:
        b = self.budget.budget
        est = self.estimator
        return {
            "policy": self.name,
            "step": self._step,
            "limits": self._limits.as_dict(),
            "effective_prefill_tokens": self.effective_prefill_tokens(),
            "budget": {**b.as_dict(), "scale": self.law.scale, "effective": int(self.law.scale * b.usable)},
            "estimator": {
                "coefficients": est.coefficients(),
                "margin": {
                    "prefill": est.relative_margin(True),
                    "decode": est.relative_margin(False),
                    "floor_bytes": int(est.margin_floor * MIB),
                },
                "samples": est.total_samples,
                "trained": est.trained,
                "resets": est.resets,
                "last_residual": est.last_residual,
                "last_prediction_bytes": int(self._last_pred * MIB),
                "last_peak_bytes": None if self._last_peak is None else int(self._last_peak * MIB),
            },
            "law": self.law.state(),
            "emergency": self.law.emergency,
            "kv_reservation": self.kv.state(),
            "kv_pool": self.pool.state(),
            "counters": dict(self.counters),
            "ranks": ranks_state(self._ranks),
            "decisions": export(self.decisions),
            "config": self.cfg.as_dict(),
        }

    def stats(self) -> ControllerStats:
        c, pool = self.counters, self.pool
        return ControllerStats(
            backoffs=c["backoffs"],
            deferrals=c["deferrals"],
            chunks=c["chunks"],
            ooms_recovered=c["ooms_recovered"],
            rejected_too_long=c["rejected_too_long"],
            kv_pool_resizes=c["kv_pool_resizes"],
            budget_bytes=int(self.law.scale * self.budget.budget.usable),
            predicted_peak_bytes=int(self._last_pred * MIB),
            margin_bytes=int(self.estimator.margin_floor * MIB),
            emergency=self.law.emergency,
            kv_pool_bytes=pool.num_blocks * pool.block_bytes if pool.enabled else None,
            effective_prefill_tokens=self.effective_prefill_tokens(),
        )

    def update_config(self, patch: dict[str, Any]) -> None:
        """Validate and apply gains at run time, all or nothing (ValueError names the bad gain)."""
        new = self.cfg.replace(patch)
        self.cfg = new
        self.estimator.configure(**self._estimator_gains(new))
        self.retained.configure(**self._estimator_gains(new))
        self.budget.configure(new.headroom_frac, new.headroom_min_mib, new.use_device_used)
        self.law.configure(new)
        self.kv.configure(new)
        self.pool.configure(new)
        self._limits_key = None
        self._thresholds_moved()
        self._refresh_limits()
        self._log("config", "gains updated: " + ", ".join(f"{k}={v}" for k, v in sorted(patch.items())))

    # --- internals ------------------------------------------------------------------------------------
    def _learn(self, rec: StepRecord) -> tuple[float | None, float | None, bool]:
        """Feed the estimators and the budget from a sampled record; returns the step's peak and the usable
        memory it had (MiB; None when not sampled) and whether the allocator had to retry."""
        m, shape, oom = step_memory(rec), rec.shape, rec.oom
        budget, est = self.budget, self.estimator
        retained_now = budget.observe(m)
        if retained_now is None:
            return None, None, False
        # what the previous step left allocated into this one
        prev = self._prev
        if prev is not None and prev[0] == rec.step_id - 1 and not prev[2]:
            self.retained.update(prev[1], retained_now / MIB)
        self._prev = (rec.step_id, shape, oom)
        if oom:  # the failed step's tensors are gone; what was retained before it stays
            self._retained_next = retained_now / MIB
        else:
            r = self.retained
            self._retained_next = r.bound(r.predict(shape), shape.prefill_tokens > 0)
        peak = self._last_peak = m.step_peak / MIB
        free_now = budget.free_now(m)
        usable_now = free_now - budget.headroom() / MIB
        resets = est.resets
        if oom:
            # The step died at the limit: its true peak is at least what was free for it.
            est.update(shape, max(peak, free_now), censored=True)
        elif shape.prefill_tokens or shape.decode_seqs:
            est.update(shape, peak)
        self._last_pred = est.last_prediction
        if est.resets != resets:
            self.counters["estimator_resets"] += 1
            self._log("estimator_reset", "OOM" if oom else f"plant change: relative residual {est.last_residual:+.2f}")
        retry = self._last_retries is not None and m.alloc_retries > self._last_retries
        self._last_retries = m.alloc_retries
        budget.next_budget(self._retained_next * MIB)
        return peak, usable_now, retry

    def _feedback(
        self, rec: StepRecord, cuts: MemoryCuts, peak: float | None, usable_now: float | None, retry: bool
    ) -> None:
        """The control law, the KV reservation, the pool's demand and the counters, from one step."""
        counters, shape, law = self.counters, rec.shape, self.law
        if rec.oom:
            counters["ooms_recovered"] += 1
        events = law.observe(
            rec.step_id, peak, usable_now, rec.oom, retry, shape.prefill_tokens, shape.decode_seqs, cuts.cut
        )
        if events:
            for e in events:
                self._log(e.action, e.reason)
            counters["backoffs"] = law.backoffs
        if rec.preempted:
            counters["preemptions"] += rec.preempted
        if why := self.kv.observe(rec.preempted, shape.decode_seqs):
            self._log("kv_ratio", why)
        packed = bool(cuts.chunks or cuts.deferred)
        if self.pool.enabled:
            spare = rec.kv_blocks_free - rec.kv_blocks_owed
            if why := self.pool.note_demand(rec.step_id, rec.preempted, packed, spare):
                self._log("kv_pool_demand", why)
        if packed:
            counters["chunks"] += cuts.chunks
            counters["deferrals"] += cuts.deferred
            chunks, defers, pred, threshold, scale = (
                cuts.chunks,
                cuts.deferred,
                self._last_pred,
                self._t_prefill,
                law.scale,
            )
            # formatted when read: memory-bound serving logs this every step (each replacing the last),
            # and the f-string cost ~3 us a step on the slow build CPU
            self._log(
                "pack",
                lambda: (
                    f"{chunks} chunked, {defers} deferred: predicted {pred:.0f} MiB vs "
                    f"threshold {threshold:.0f} MiB (scale {scale:.2f})"
                ),
                quiet=True,
            )

    def _thresholds_moved(self) -> None:
        """The budget changed outside a step (a pool resize, new gains): recompute the thresholds now."""
        self._refresh_key = None
        self._refresh()
        self._budget = None

    def _refresh(self) -> None:
        """Precompute the next step's thresholds (controller/admission.py: thresholds)."""
        b, est, ret = self.budget.budget, self.estimator, self.retained
        # The thresholds depend on the budget, the scale and the margins, not on the coefficients: a
        # learning step whose margins did not move keeps them.
        key = (b, self.law.scale, est.windows[True].value, est.windows[False].value, ret.windows[True].value)
        if key == self._refresh_key:
            return
        self._refresh_key = key
        t = thresholds(b, self.budget.headroom_min, self.law.scale, est, ret)
        self._t_prefill, self._t_decode, self._t_pair, self._t_worst = t

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
