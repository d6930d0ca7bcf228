"""Online model of a step's memory peak above idle, from the step's shape.

peak_MiB ~ theta . x(shape), x = (1, prefill_tokens, prefill_seqs, decode_seqs, sum_context, prefill_attn,
sampled_seqs), each feature scaled to O(1) so one prior variance suits all. Why these parts:
- recursive least squares with a forgetting factor: one small update per sampled step, old plant
  behaviour fades, so a new model or backend is learnt without a restart;
- covariance bounded by a trace cap: long decode-only stretches would otherwise blow up the covariance
  of the prefill directions (estimator windup) and the next prefill sample would jerk the model;
- non-negative coefficients (projection after each update): no feature frees memory, and a negative
  coefficient extrapolates to "a huge prefill costs nothing";
- change detection: several consecutive large relative residuals (or an OOM) reset the covariance,
  so the next samples dominate (re-learn in a handful of steps instead of 1/(1-forgetting));
- margin: an upper quantile of recent *relative* residuals, kept apart for prefill steps and for
  decode-only steps (a split-conformal bound per regime; pooled, the abundant easy decode steps would
  hide the errors of the rare big prefills). A fresh large residual raises the margin at once;
- event-triggered learning: a step the model already predicts within 5 % skips the RLS update (at
  most 7 in a row), since steady serving repeats the same shapes and the update is most of the cost.
Pure Python on purpose: on matrices this small numpy's per-call overhead costs as much as the arithmetic
(bench/results/controller_decision.md times a step). `active` learns a subset of the features
(RLS cost is quadratic in their number).
"""

from __future__ import annotations

from collections import deque
from operator import getitem, mul

from telemetry.record import StepShape
from telemetry.units import MIB

FEATURES = ("intercept", "prefill_tokens", "prefill_seqs", "decode_seqs", "sum_context", "prefill_attn", "sampled_seqs")
# Feature scales: a typical large value of each, so scaled features are O(1).
SCALES = (1.0, 1024.0, 8.0, 64.0, 16384.0, float(1 << 22), 64.0)
N = len(FEATURES)
_RECOMPUTE_EVERY = 8
_SKIP_TOLERANCE = 0.05  # relative residual below which a step may skip the RLS update
_SKIP_MAX = 7  # ... but at least every 8th step is learnt


def features(shape: StepShape) -> list[float]:
    """Scaled feature vector of a step shape."""
    return [
        1.0,
        shape.prefill_tokens / 1024.0,
        shape.prefill_seqs / 8.0,
        shape.decode_seqs / 64.0,
        shape.sum_context / 16384.0,
        shape.prefill_attn / float(1 << 22),
        shape.sampled_seqs / 64.0,
    ]


def predict(r: list[float], s: StepShape) -> float:
    """Predicted step peak above idle (MiB) from raw coefficients r (MiB per unit of each of FEATURES):
    the estimator's own prediction, and admission's with its summed coefficient vectors."""
    return (
        r[0]
        + r[1] * s.prefill_tokens
        + r[2] * s.prefill_seqs
        + r[3] * s.decode_seqs
        + r[4] * s.sum_context
        + r[5] * s.prefill_attn
        + r[6] * s.sampled_seqs
    )


class _QuantileWindow:
    """Upper quantile of the last `size` values, re-sorted every few inserts; a new value above the
    cached quantile raises it at once (the margin grows immediately, shrinks lazily)."""

    def __init__(self, size: int, q: float, cold: float, min_samples: int = 4) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.q = q
        self.cold = cold
        self.min_samples = min_samples
        self.value = cold
        self._since = 0

    def add(self, v: float) -> None:
        self.values.append(v)
        self._since += 1
        if len(self.values) < self.min_samples:
            self.value = max(self.cold, v)
        elif v > self.value:
            self.value = v
        elif self._since >= _RECOMPUTE_EVERY:
            self.recompute()

    def clear(self) -> None:
        self.values.clear()
        self._since = 0
        self.value = self.cold

    def recompute(self) -> None:
        self._since = 0
        if len(self.values) < self.min_samples:
            self.value = max([self.cold, *self.values])
            return
        s = sorted(self.values)
        self.value = s[min(len(s) - 1, int(self.q * len(s)))]


class PeakEstimator:
    """RLS estimate of the step peak above idle, in MiB, plus a per-regime safety margin."""

    def __init__(
        self,
        forgetting: float = 0.995,
        prior_variance: float = 100.0,
        margin_quantile: float = 0.95,
        margin_window: int = 64,
        margin_floor_mib: float = 16.0,
        margin_cold: float = 0.5,
        change_threshold: float = 0.5,
        change_count: int = 2,
        active: tuple[str, ...] = FEATURES,
    ) -> None:
        # Only these features are learnt (the others stay 0): fewer features, quadratically cheaper RLS.
        self.active = [FEATURES.index(a) for a in active]
        self.n = len(self.active)
        self._scales = [SCALES[i] for i in self.active]
        self.theta = [0.0] * self.n
        self.prior_variance = prior_variance
        self.P: list[list[float]] = []
        self._reset_cov()
        self.forgetting = forgetting
        self.margin_floor = margin_floor_mib
        self.change_threshold = change_threshold
        self.change_count = change_count
        self.windows = {
            True: _QuantileWindow(margin_window, margin_quantile, margin_cold),  # steps with prefill
            False: _QuantileWindow(margin_window, margin_quantile, margin_cold),  # decode-only steps
        }
        self.samples = 0  # RLS updates since the last reset
        self.total_samples = 0  # sampled steps seen
        self.resets = 0
        self._run = 0  # consecutive large residuals of the same sign
        self._raw = [0.0] * N  # theta / scale on all 7 features: MiB per raw unit, for fast predictions
        self.version = 0  # bumped whenever the coefficients change
        self.last_residual = 0.0
        self.last_prediction = 0.0
        self._skipped = 0

    # --- configuration ---------------------------------------------------------------------------------
    def configure(
        self,
        forgetting: float,
        prior_variance: float,
        margin_quantile: float,
        margin_window: int,
        margin_floor_mib: float,
        margin_cold: float,
        change_threshold: float,
        change_count: int,
    ) -> None:
        """Apply new gains, keeping what has been learnt."""
        self.forgetting = forgetting
        self.prior_variance = prior_variance
        self.margin_floor = margin_floor_mib
        self.change_threshold = change_threshold
        self.change_count = change_count
        for w in self.windows.values():
            w.q = margin_quantile
            w.cold = margin_cold
            if w.values.maxlen != margin_window:
                w.values = deque(w.values, maxlen=margin_window)
            w.recompute()

    def _reset_cov(self) -> None:
        n = self.n
        self.P = [[self.prior_variance if i == j else 0.0 for j in range(n)] for i in range(n)]

    def reset(self, reason: str = "") -> None:
        """Covariance resetting: keep theta as the prior mean, make the next samples dominate."""
        self._reset_cov()
        self.samples = 0
        self.resets += 1
        self._run = 0
        for w in self.windows.values():  # old residuals describe the old plant: margin goes cold
            w.clear()

    # --- prediction --------------------------------------------------------------------------------------
    @property
    def raw(self) -> list[float]:
        """MiB per raw feature unit (intercept, per token, per seq, ...)."""
        return self._raw

    def predict(self, shape: StepShape) -> float:
        return predict(self._raw, shape)

    def relative_margin(self, prefill: bool) -> float:
        """q such that peak <= pred + q * (pred + floor) + floor held on recent steps of this regime."""
        return max(0.0, self.windows[prefill].value)

    def bound(self, pred: float, prefill: bool) -> float:
        """Prediction plus margin, MiB."""
        f = self.margin_floor
        return pred + max(0.0, self.windows[prefill].value) * (pred + f) + f

    @property
    def trained(self) -> bool:
        return self.samples > self.n

    # --- learning ----------------------------------------------------------------------------------------
    def update(self, shape: StepShape, peak_mib: float, censored: bool = False) -> float:
        """Learn from one sampled step; returns the a-priori relative residual. `censored`: the step hit
        an OOM, so `peak_mib` is only a lower bound; it is learnt as a value and treated as a change."""
        pred = self.predict(shape)
        self.last_prediction = pred
        err = peak_mib - pred
        rel = err / (pred + self.margin_floor + 1e-9)
        self.last_residual = rel
        trained = self.trained  # read once for the two checks below (a property call costs here)
        if trained:  # an untrained model's errors say nothing about the margin it needs
            self.windows[shape.prefill_tokens > 0].add(min(rel, 4.0))
        # change detection (an untrained model's large errors are expected, not a change)
        if censored:
            self.reset("oom")
        elif not trained:
            self._run = 0
        elif rel > self.change_threshold:
            self._run = self._run + 1 if self._run > 0 else 1
        elif rel < -self.change_threshold:
            self._run = self._run - 1 if self._run < 0 else -1
        else:
            self._run = 0
        if abs(self._run) >= self.change_count:
            self.reset("change")
        self.total_samples += 1
        # Event-triggered learning: steady serving repeats nearly the same shapes; when the model already
        # predicts a step well, the update teaches little and is most of the controller's cost. Learn on
        # surprise, and at least every 8th step.
        if not censored and self.trained and abs(rel) < _SKIP_TOLERANCE and self._skipped < _SKIP_MAX:
            self._skipped += 1
            return rel
        self._skipped = 0
        x = features(shape)
        self._rls([x[i] for i in self.active] if self.n < N else x, peak_mib)
        self.samples += 1
        return rel

    def _rls(self, x: list[float], y: float) -> None:
        """One RLS step with forgetting, in plain lists (see the module docstring for why). Hot: on a slow
        CPU it is a third of a learning step, so no `zip(strict=...)` in the loops (its keyword call is paid
        on every zip, and the lengths are equal by construction) and no multiplies by a scale of 1."""
        P, th, lam, n = self.P, self.theta, self.forgetting, self.n
        Px = [sum(map(mul, row, x)) for row in P]
        inv = 1.0 / (lam + sum(map(mul, x, Px)))
        err = (y - sum(map(mul, th, x))) * inv
        # covariance windup guard: forget only while the covariance is bounded (trace = sum of P[i][i])
        forget = sum(map(getitem, P, range(n))) < self.prior_variance * n
        # P <- scale * (P - Px Px' * inv), scale = 1 / lam while forgetting, else 1: then p * 1.0 == p and
        # k == Px, so the n * n multiplies by the scale are skipped (same numbers, fewer operations)
        scale = 1.0 / lam
        k = [p * scale for p in Px] if forget else Px
        for i, pi in enumerate(Px):
            th[i] += pi * err
            ki = pi * inv
            if forget:
                P[i] = [p * scale - ki * q for p, q in zip(P[i], k)]  # noqa: B905
            else:
                P[i] = [p - ki * q for p, q in zip(P[i], k)]  # noqa: B905
        if min(th) < 0.0:
            self._project(th, P)
        raw = self._raw
        for i, t, sc in zip(self.active, th, self._scales):  # noqa: B905
            raw[i] = t / sc
        self.version += 1

    @staticmethod
    def _project(th: list[float], P: list[list[float]]) -> None:
        """Non-negativity: fix the most negative coefficient at 0 and move the others to their mean
        conditional on it (theta -= P[:, i] * theta_i / P[i, i]), a few rounds, then clip what is left.
        Plain clipping is not enough: with correlated features the clipped mass reappears in the other
        coefficients every update and the prediction drifts away from what is measured."""
        n = len(th)
        for _ in range(3):
            i = min(range(n), key=th.__getitem__)
            v = th[i]
            if v >= 0.0:
                return
            pii = P[i][i]
            if pii <= 0.0:
                break
            f = v / pii
            for j in range(n):
                th[j] -= P[j][i] * f
            th[i] = 0.0
        for j in range(n):
            if th[j] < 0.0:
                th[j] = 0.0

    # --- observability -----------------------------------------------------------------------------------
    def coefficients(self) -> dict[str, float]:
        """Learnt cost of each feature in bytes per unit (intercept: bytes per step)."""
        return {name: self._raw[i] * MIB for i, name in enumerate(FEATURES)}
