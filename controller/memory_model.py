"""What the next step may use: the adaptive policy's model of the device's memory, learnt from every step.

From each sampled step record it feeds
- the step-peak estimator (OOM steps as a lower bound: the step died at the limit),
- the retained-memory estimator (what a step leaves allocated into the next one, e.g. logits an engine
  keeps referenced: it is part of the next step's idle and unknown when that step is packed),
- the budget (capacity, memory outside the allocator and idle floor, as the probe saw them),
and precomputes the next step's thresholds, from which MemoryFit (controller/admission.py) answers what fits.
The control law's scale is an input here, never state: the law is the policy's (controller/law.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.admission import INF, MemoryFit, decodes_that_fit, thresholds
from controller.budget import BudgetTracker
from controller.config import ControllerConfig
from controller.estimator import PeakEstimator, predict
from controller.tightest_rank import step_memory
from telemetry.record import StepRecord, StepShape
from telemetry.units import MIB

RETAINED_FEATURES = ("intercept", "prefill_tokens", "decode_seqs", "sampled_seqs")


@dataclass(frozen=True, slots=True)
class Learnt:
    """What one step taught: its peak and the usable memory it had (MiB; None when not sampled), whether the
    allocator had to retry, and why the estimator reset (None: it did not)."""

    peak: float | None = None
    usable_now: float | None = None
    retry: bool = False
    reset: str | None = None


NOT_SAMPLED = Learnt()


def estimator_gains(c: ControllerConfig) -> dict[str, Any]:
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


class MemoryModel:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.estimator = PeakEstimator(**estimator_gains(cfg))
        # bytes a step leaves allocated into the next one (see budget.py): outputs of the step, so the
        # rows it computes matter, not its context or attention
        self.retained = PeakEstimator(**estimator_gains(cfg), active=RETAINED_FEATURES)
        self.budget = BudgetTracker(cfg.headroom_frac, cfg.headroom_min_mib, cfg.use_device_used)
        self._raw = self.estimator.raw  # live list, updated in place by the estimator
        self._t_prefill = INF
        self._t_decode = INF
        # "leave room for the successor": this step's peak plus what it retains into the next step must
        # fit the budget without the current step's predecessor (see refresh)
        self._t_pair = INF
        self._t_worst = INF
        self._last_retries: int | None = None
        self.last_prediction = 0.0  # MiB
        self.last_peak: float | None = None  # MiB
        self._prev: tuple[int, StepShape, bool] | None = None  # (step id, shape, oom) of the last sample
        self._retained_next = 0.0
        self._refresh_key: tuple | None = None

    def configure(self, cfg: ControllerConfig) -> None:
        """New gains; call moved() after, as the thresholds depend on them."""
        self.cfg = cfg
        self.estimator.configure(**estimator_gains(cfg))
        self.retained.configure(**estimator_gains(cfg))
        self.budget.configure(cfg.headroom_frac, cfg.headroom_min_mib, cfg.use_device_used)

    def memory_fit(self) -> MemoryFit:
        """The next step's checks, frozen: a snapshot of the coefficients and thresholds."""
        return MemoryFit(
            tuple(self._raw),
            tuple(self.retained.raw),
            self._t_prefill,
            self._t_decode,
            self._t_pair,
            self._t_worst,
            self.cfg.min_chunk,
        )

    def largest_prefill(self, cap: int) -> int:
        """Prompt tokens, up to `cap`, that memory admits into a step that carries nothing else."""
        return self.memory_fit().largest_chunk(StepShape(), 0, cap)

    def decodes_that_fit(self, context: int) -> int:
        """Decodes of `context` tokens that memory alone admits into an empty step (up to max_decode_seqs)."""
        return decodes_that_fit(self._raw, StepShape(), [context] * self.cfg.max_decode_seqs, self._t_decode)

    def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request can never fit, or None: with the model trained, even the smallest last chunk of the
        prompt, or the final decode of prompt + max_tokens, alone on a step, is predicted (without margin)
        to need more than all the memory above idle the device would have if other processes gave theirs
        back."""
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
        return (
            f"request cannot fit in device memory: {what} needs ~{need:.0f} MiB above idle, "
            f"only {free:.0f} MiB are free"
        )

    def learn(self, rec: StepRecord) -> Learnt:
        """Feed the estimators and the budget from a sampled record."""
        m, shape, oom = step_memory(rec), rec.shape, rec.oom
        budget, est = self.budget, self.estimator
        retained_now = budget.observe(m)
        if retained_now is None:
            return NOT_SAMPLED
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
        peak = self.last_peak = m.step_peak / MIB
        free_now = budget.free_now(m)
        usable_now = free_now - budget.headroom() / MIB
        resets = est.resets
        if oom:
            # The step died at the limit: its true peak is at least what was free for it.
            est.update(shape, max(peak, free_now), censored=True)
        elif shape.prefill_tokens or shape.decode_seqs:
            est.update(shape, peak)
        self.last_prediction = est.last_prediction
        reset = None
        if est.resets != resets:
            reset = "OOM" if oom else f"plant change: relative residual {est.last_residual:+.2f}"
        retry = self._last_retries is not None and m.alloc_retries > self._last_retries
        self._last_retries = m.alloc_retries
        budget.next_budget(self._retained_next * MIB)
        return Learnt(peak, usable_now, retry, reset)

    def moved(self, scale: float) -> None:
        """The budget changed outside a step (a pool resize, new gains): recompute the thresholds now."""
        self._refresh_key = None
        self.refresh(scale)

    def refresh(self, scale: float) -> None:
        """Precompute the next step's thresholds for the control law's `scale` (admission.py: thresholds)."""
        b, est, ret = self.budget.budget, self.estimator, self.retained
        # The thresholds depend on the budget, the scale and the margins, not on the coefficients: a
        # learning step whose margins did not move keeps them.
        key = (b, scale, est.windows[True].value, est.windows[False].value, ret.windows[True].value)
        if key == self._refresh_key:
            return
        self._refresh_key = key
        t = thresholds(b, self.budget.headroom_min, scale, est, ret)
        self._t_prefill, self._t_decode, self._t_pair, self._t_worst = t

    def state(self) -> dict[str, Any]:
        """The estimator's part of GET /controller/state."""
        est = self.estimator
        return {
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
            "last_prediction_bytes": int(self.last_prediction * MIB),
            "last_peak_bytes": None if self.last_peak is None else int(self.last_peak * MIB),
        }

    @property
    def prefill_threshold(self) -> float:
        """T_prefill, MiB: what the pack decision's reason quotes."""
        return self._t_prefill
