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
  hide the errors of the rare big prefills). A fresh large residual raises the margin at once.
Pure Python on purpose: a 7x7 RLS update with sparse features is ~10 us here, less than numpy's
per-call overhead on such small matrices.
"""

from __future__ import annotations

from collections import deque

from telemetry.record import StepShape

MIB = float(1 << 20)
FEATURES = ("intercept", "prefill_tokens", "prefill_seqs", "decode_seqs", "sum_context", "prefill_attn",
            "sampled_seqs")
# Feature scales: a typical large value of each, so scaled features are O(1).
SCALES = (1.0, 1024.0, 8.0, 64.0, 16384.0, float(1 << 22), 64.0)
N = len(FEATURES)
_RECOMPUTE_EVERY = 8


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


class _QuantileWindow:
    """Upper quantile of the last `size` values, re-sorted every few inserts; a new value above the
    cached quantile raises it at once (the margin grows immediately, shrinks lazily)."""

    def __init__(self, size: int, q: float, cold: float, min_samples: int = 8) -> None:
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
        margin_quantile: float = 0.99,
        margin_window: int = 128,
        margin_floor_mib: float = 16.0,
        margin_cold: float = 0.5,
        change_threshold: float = 0.5,
        change_count: int = 2,
    ) -> None:
        self.theta = [0.0] * N
        self.prior_variance = prior_variance
        self.P = [0.0] * (N * N)
        self._reset_cov()
        self.forgetting = forgetting
        self.margin_floor = margin_floor_mib
        self.change_threshold = change_threshold
        self.change_count = change_count
        self.windows = {
            True: _QuantileWindow(margin_window, margin_quantile, margin_cold),  # steps with prefill
            False: _QuantileWindow(margin_window, margin_quantile, margin_cold),  # decode-only steps
        }
        self.samples = 0  # sampled updates since the last reset
        self.total_samples = 0
        self.resets = 0
        self._run = 0  # consecutive large residuals of the same sign
        self._raw = [0.0] * N  # theta / scale: MiB per raw feature unit, for fast predictions
        self.last_residual = 0.0

    # --- configuration ---------------------------------------------------------------------------------
    def configure(self, forgetting: float, prior_variance: float, margin_quantile: float, margin_window: int,
                  margin_floor_mib: float, margin_cold: float, change_threshold: float,
                  change_count: int) -> None:
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
        P = self.P
        for i in range(N * N):
            P[i] = 0.0
        for i in range(N):
            P[i * N + i] = self.prior_variance

    def reset(self, reason: str = "") -> None:
        """Covariance resetting: keep theta as the prior mean, make the next samples dominate."""
        self._reset_cov()
        self.samples = 0
        self.resets += 1
        self._run = 0

    # --- prediction --------------------------------------------------------------------------------------
    @property
    def raw(self) -> list[float]:
        """MiB per raw feature unit (intercept, per token, per seq, ...)."""
        return self._raw

    def predict(self, shape: StepShape) -> float:
        r = self._raw
        return (r[0] + r[1] * shape.prefill_tokens + r[2] * shape.prefill_seqs + r[3] * shape.decode_seqs
                + r[4] * shape.sum_context + r[5] * shape.prefill_attn + r[6] * shape.sampled_seqs)

    def relative_margin(self, prefill: bool) -> float:
        """q such that peak <= pred + q * (pred + floor) + floor held on recent steps of this regime."""
        return max(0.0, self.windows[prefill].value)

    def bound(self, pred: float, prefill: bool) -> float:
        """Prediction plus margin, MiB."""
        f = self.margin_floor
        return pred + max(0.0, self.windows[prefill].value) * (pred + f) + f

    @property
    def trained(self) -> bool:
        return self.samples >= 2 * N

    # --- learning ----------------------------------------------------------------------------------------
    def update(self, shape: StepShape, peak_mib: float, censored: bool = False) -> float:
        """Learn from one sampled step; returns the a-priori relative residual. `censored`: the step hit
        an OOM, so `peak_mib` is only a lower bound; it is learnt as a value and treated as a change."""
        x = features(shape)
        pred = self.predict(shape)
        err = peak_mib - pred
        rel = err / (pred + self.margin_floor + 1e-9)
        self.last_residual = rel
        if self.trained:  # an untrained model's errors say nothing about the margin it needs
            self.windows[shape.prefill_tokens > 0].add(min(rel, 4.0))
        # change detection
        if censored:
            self.reset("oom")
        elif rel > self.change_threshold:
            self._run = self._run + 1 if self._run > 0 else 1
        elif rel < -self.change_threshold:
            self._run = self._run - 1 if self._run < 0 else -1
        else:
            self._run = 0
        if abs(self._run) >= self.change_count:
            self.reset("change")
        self._rls(x, peak_mib)
        self.samples += 1
        self.total_samples += 1
        return rel

    def _rls(self, x: list[float], y: float) -> None:
        P, th, lam = self.P, self.theta, self.forgetting
        idx = [i for i in range(N) if x[i] != 0.0]
        Px = [sum(P[i * N + j] * x[j] for j in idx) for i in range(N)]
        denom = lam + sum(x[i] * Px[i] for i in idx)
        err = y - sum(th[i] * x[i] for i in idx)
        inv = 1.0 / denom
        k = [p * inv for p in Px]
        # covariance windup guard: forget only while the covariance is bounded
        trace = sum(P[i * N + i] for i in range(N))
        scale = 1.0 / lam if trace < self.prior_variance * N else 1.0
        for i in range(N):
            ki = k[i]
            th[i] = max(0.0, th[i] + ki * err)
            row = i * N
            for j in range(i, N):
                v = (P[row + j] - ki * Px[j]) * scale
                P[row + j] = v
                P[j * N + i] = v
        raw = self._raw
        for i in range(N):
            raw[i] = th[i] / SCALES[i]

    # --- observability -----------------------------------------------------------------------------------
    def coefficients(self) -> dict[str, float]:
        """Learnt cost of each feature in bytes per unit (intercept: bytes per step)."""
        return {name: self._raw[i] * MIB for i, name in enumerate(FEATURES)}
