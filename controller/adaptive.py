"""AdaptivePolicy: the memory-feedback controller behind the scheduler's Policy protocol.

Each step: the scheduler asks `limits()` (cached; rebuilt only when a cap or the KV ratio moves) and
`fit_decodes` / `fit_chunk` while packing (a few multiply-adds against thresholds precomputed once per
step); the engine then reports the step's record to `observe()`, which feeds
- the step-peak estimator (sampled records only; OOM steps as a lower bound),
- the retained-memory estimator (what a step leaves allocated into the next one, e.g. logits an engine
  keeps referenced: it is part of the next step's idle and unknown when that step is packed),
- the budget (capacity, memory outside the allocator and idle floor, as the probe saw them),
- the control law (budget scale and caps) and the KV reservation ratio,
and precomputes the next step's thresholds (see _refresh for the three checks on a prefill chunk).
`state()` is GET /controller/state; `update_config()` patches gains atomically at run time.
`observe_finished()` hands each finished request's output length to the KV reservation.

Not thread-safe, by design: the engine thread owns the policy, and the server reaches it through the
engine's command queue (engine/serving/async_engine.py), so no call here needs a lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import add
from typing import Any

from controller.admission import INF, decodes_that_fit, is_empty, largest_chunk
from controller.budget import MIB, BudgetTracker
from controller.config import ControllerConfig
from controller.estimator import PeakEstimator, predict
from controller.kv_pool import PoolSizer
from controller.kv_reservation import KVReservation
from controller.law import ControlLaw
from controller.limits import UNLIMITED, Limits
from telemetry.record import MemorySample, StepRecord, StepShape

DECISIONS_KEPT = 50
RETAINED_FEATURES = ("intercept", "prefill_tokens", "decode_seqs", "sampled_seqs")


class AdaptivePolicy:
    name = "adaptive"
    recovers_oom = True

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
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        self._raw = self.estimator.raw  # live list, updated in place by the estimator
        self._t_prefill = INF
        self._t_decode = INF
        # "leave room for the successor": this step's peak plus what it retains into the next step must
        # fit the budget without the current step's predecessor (see _refresh)
        self._raw_pair = [0.0] * len(self._raw)
        self._t_pair = INF
        self._raw_worst = [0.0] * len(self._raw)
        self._t_worst = INF
        self._versions = (-1, -1)  # estimator versions _raw_pair / _raw_worst were summed from
        self._last_retries: int | None = None
        self._step = 0
        # what admission did on the step being packed; consumed by observe()
        self._cut = False
        self._step_chunks = 0
        self._step_defers = 0
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

    def fit_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        c = self._largest_chunk(shape, context, chunk)
        if c >= chunk:
            return chunk
        if is_empty(shape):
            c = max(c, min(chunk, self.cfg.min_chunk))  # liveness: an empty step always makes progress
        if c < self.cfg.min_chunk and c < chunk:
            c = 0
        self._cut = True
        if c:
            self._step_chunks += 1
            self.counters["chunks"] += 1
        else:
            self._step_defers += 1
            self.counters["deferrals"] += 1
        return c

    def fit_decodes(self, shape: StepShape, contexts: list[int]) -> int:
        limit = self._t_decode if shape.prefill_tokens == 0 else self._t_prefill
        n = decodes_that_fit(self._raw, shape, contexts, limit)
        if n == len(contexts):
            return n
        if n == 0 and is_empty(shape):
            return 1  # liveness
        self._cut = True
        self._step_defers += len(contexts) - n
        self.counters["deferrals"] += len(contexts) - n
        return n

    def _largest_chunk(self, shape: StepShape, context: int, chunk: int) -> int:
        """The three checks of _refresh, without counting anything."""
        c = largest_chunk(self._raw, shape, context, chunk, self._t_prefill)
        if c:
            versions = (self.estimator.version, self.retained.version)
            if versions != self._versions:
                self._sum_coefficients(versions)
            c = largest_chunk(self._raw_pair, shape, context, c, self._t_pair)
        if c:
            c = largest_chunk(self._raw_worst, shape, context, c, self._t_worst)
        return c

    def _sum_coefficients(self, versions: tuple[int, int]) -> None:
        """Rebuild the pair and worst-case coefficient vectors (peak + retained, peak + 2 x retained) after
        either estimator learnt. Only prefill chunk checks read them, so this runs on the first such check
        rather than in every learning step's _refresh: decode-only steps never pay for it."""
        self._versions = versions
        raw, rr = self._raw, self.retained.raw
        self._raw_pair = list(map(add, raw, rr))
        self._raw_worst = list(map(add, raw, map(add, rr, rr)))  # r + r == 2.0 * r, exactly

    def effective_prefill_tokens(self) -> int:
        """The prefill limit that binds now: the prompt tokens the next step could take when it carries
        nothing else (fresh prompts), the smaller of the cap and what memory admits."""
        return self._largest_chunk(StepShape(), 0, self.law.prefill_cap)

    def memory_decode_seqs(self, context: int) -> int:
        """Decodes of `context` tokens that memory alone admits into an empty step (up to the
        max_decode_seqs ceiling; the trust-region cap is not applied)."""
        return decodes_that_fit(self._raw, StepShape(), [context] * self.cfg.max_decode_seqs, self._t_decode)

    def reject_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Only certain failures: with the model trained, even the smallest last chunk of the prompt, or
        the final decode of prompt + max_tokens, alone on a step, is predicted (without margin) to need
        more than all free memory above idle."""
        b = self.budget.budget
        if not b.known or not self.estimator.trained:
            return None
        free = b.free_mib + b.retained / MIB  # reject on what a step alone would have
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

    def observe(self, record: StepRecord) -> None:
        self._observe(record)

    # --- KV pool sizing (controller/kv_pool.py) -------------------------------------------------------
    def size_kv_pool(self, num_blocks: int, block_bytes: int, profile: list[MemorySample]) -> int:
        """Take over the pool: `profile` is what the start-up profiling steps measured with `num_blocks`
        blocks of `block_bytes`. Returns the pool size to start with."""
        for m in profile:
            self.budget.observe(m)
        idle = self.budget.idle_floor or 0
        reserve = max(max(m.peak_allocated, m.reserved) - idle for m in profile)
        self.pool.start(num_blocks, block_bytes, reserve)
        self._pool_reason = "start-up sizing"
        room = self._pool_room(profile[-1])
        target = max(1, num_blocks + self.pool.blocks_for_room(room))
        b = self.budget
        external = b.external_at(profile[-1])
        self.pool.sizing = {
            "profiled_tokens": self.cfg.pool_reserve_tokens,
            "profile_steps": len(profile),
            "capacity": b.capacity,
            "external": external,
            "idle_without_pool": idle - num_blocks * block_bytes,
            "headroom": b.headroom(),
            "reserve": reserve,
            "block_bytes": block_bytes,
            "num_blocks": target,
        }
        self._log(
            "kv_pool_size",
            f"start-up: {target} blocks of {block_bytes / MIB:.1f} MiB beside a "
            f"{reserve / MIB:.0f} MiB reserve (profiled {self.cfg.pool_reserve_tokens}-token prefill), "
            f"{b.headroom() / MIB:.0f} MiB headroom, {external / MIB:.0f} MiB outside",
        )
        return target

    def kv_pool_target(self, memory: MemorySample) -> int | None:
        """Before a step is packed: the pool size to move to now (None: keep it). `memory` is the probe's
        latest sample, so memory another process took since the last step counts."""
        if not self.pool.enabled:
            return None
        decision = self.pool.decide(self._step, self._pool_room(memory))
        if decision is None:
            return None
        self._pool_reason = decision[1]
        return decision[0]

    def kv_pool_preempt_target(self) -> int | None:
        """After kv_pool_target asked for a shrink: the size the pool must reach even by preempting."""
        return self.pool.preempt_target if self.pool.enabled else None

    def observe_pool(self, old: int, new: int, error: str | None = None, preempted: int = 0) -> None:
        """The engine resized the pool from `old` to `new` blocks (error: it could not), having preempted
        `preempted` running sequences first (the last resort: the target was below the blocks in use)."""
        pool = self.pool
        if preempted:
            self.counters["kv_pool_preemptions"] += preempted
            self._log(
                "kv_pool_preempt",
                f"{preempted} newest running sequences preempted by recompute: the pool "
                f"({old} blocks) must shrink below the blocks in use ({self._pool_reason})",
            )
            if why := pool.note_demand(self._step, preempted, False, 0):
                self._log("kv_pool_demand", why)
        pool.resized(self._step, new, error is None)
        if error is not None:
            self._log("kv_pool_failed", f"resize {old} -> ? blocks failed: {error}")
            return
        if new == old:
            return
        self.budget.shift_idle((new - old) * pool.block_bytes)
        self.counters["kv_pool_resizes"] += 1
        self._log("kv_pool_grow" if new > old else "kv_pool_shrink", f"{old} -> {new} blocks: {self._pool_reason}")
        self._refresh_key = None
        self._refresh()

    def _pool_room(self, m: MemorySample) -> int:
        b = self.budget
        if b.idle_floor is None:
            return 0
        return int(b.capacity - self.budget.external_at(m) - b.idle_floor - b.headroom() - self.pool.reserve)

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
            "decisions": [{**d, "reason": d["reason"]()} if callable(d["reason"]) else d for d in self.decisions],
            "config": self.cfg.as_dict(),
        }

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
        self._refresh_key = None
        self._refresh()
        self._refresh_limits()
        self._log("config", "gains updated: " + ", ".join(f"{k}={v}" for k, v in sorted(patch.items())))

    # --- internals ------------------------------------------------------------------------------------
    def _observe(self, rec: StepRecord) -> None:
        step = self._step = rec.step_id
        counters = self.counters
        counters["steps"] += 1
        m, shape, oom = rec.memory, rec.shape, rec.oom
        budget, est = self.budget, self.estimator
        retained_now = budget.observe(m)
        peak: float | None = None
        usable_now: float | None = None
        retry = False
        if retained_now is not None:
            # what the previous step left allocated into this one
            prev = self._prev
            if prev is not None and prev[0] == step - 1 and not prev[2]:
                self.retained.update(prev[1], retained_now / MIB)
            self._prev = (step, shape, oom)
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
                counters["estimator_resets"] += 1
                self._log(
                    "estimator_reset", "OOM" if oom else f"plant change: relative residual {est.last_residual:+.2f}"
                )
            if self._last_retries is not None and m.alloc_retries > self._last_retries:
                retry = True
            self._last_retries = m.alloc_retries
            budget.next_budget(self._retained_next * MIB)
        if oom:
            counters["ooms_recovered"] += 1
        law = self.law
        events = law.observe(step, peak, usable_now, oom, retry, shape.prefill_tokens, shape.decode_seqs, self._cut)
        if events:
            for e in events:
                self._log(e.action, e.reason)
            counters["backoffs"] = law.backoffs
        if rec.preempted:
            counters["preemptions"] += rec.preempted
        why = self.kv.observe(rec.preempted, shape.decode_seqs)
        if why:
            self._log("kv_ratio", why)
        if self.pool.enabled:
            why = self.pool.note_demand(
                step,
                rec.preempted,
                bool(self._step_chunks or self._step_defers),
                rec.kv_blocks_free - rec.kv_blocks_owed,
            )
            if why:
                self._log("kv_pool_demand", why)
        if self._step_chunks or self._step_defers:
            chunks, defers, pred, threshold, scale = (
                self._step_chunks,
                self._step_defers,
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
            self._step_chunks = self._step_defers = 0
        self._cut = False
        self._refresh()
        self._refresh_limits()

    def _refresh(self) -> None:
        """Precompute next step's thresholds and limits.

        Three checks bound a prefill chunk:
        - T_prefill: the step's own peak fits beside what the last step retained (setpoint headroom kept);
        - T_pair: the step's peak plus what it will retain fits as if nothing were retained. This keeps
          chunk sizes even: without it a big chunk (which retains a lot) forces a small one, then a big
          one again, and in a caching allocator the small step's tensors land in the big step's cached
          segment and pin it;
        - T_worst: even so, a caching allocator can hold three segments of the step's biggest tensor at
          its peak (the one being allocated, the previous step's still referenced, and a cached one that a
          small live tensor pins), so peak + 2 x retained must fit the device with the headroom floor.
        """
        b = self.budget.budget
        est = self.estimator
        ret = self.retained
        # The thresholds depend on the budget, the scale and the margins, not on the coefficients: a
        # learning step whose margins did not move keeps them.
        key = (b, self.law.scale, est.windows[True].value, est.windows[False].value, ret.windows[True].value)
        if key == self._refresh_key:
            return
        self._refresh_key = key
        if b.known:
            scale = self.law.scale
            floor = est.margin_floor
            usable = scale * b.usable_mib
            qp = est.relative_margin(True)
            self._t_prefill = usable / (1.0 + qp) - floor
            self._t_decode = usable / (1.0 + est.relative_margin(False)) - floor
            retained = b.retained / MIB
            q = self.retained.relative_margin(True)
            q = 1.0 + (q if q > qp else qp)
            self._t_pair = (usable + scale * retained) / q - 2.0 * floor
            worst = b.free_mib + retained - self.budget.headroom_min / MIB
            self._t_worst = scale * worst / q - 3.0 * floor
        else:
            self._t_prefill = self._t_decode = self._t_pair = self._t_worst = INF

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
                allow_mixed=True,
                prefill_first=False,
                chunked_prefill=True,
            )
            self._log(
                "limits",
                f"prefill_tokens={law.prefill_cap} decode_seqs={law.decode_cap} "
                f"kv_ratio={key[2]:.2f} emergency={law.emergency}",
                quiet=True,
            )

    def _log(self, action: str, reason: str | Callable[[], str], quiet: bool = False) -> None:
        """`reason` may be a function that formats it, called when state() reads the log."""
        if quiet and self.decisions and self.decisions[-1]["action"] == action:
            self.decisions[-1] = {"step": self._step, "action": action, "reason": reason}
            return
        self.decisions.append({"step": self._step, "action": action, "reason": reason})
