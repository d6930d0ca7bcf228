"""The peak estimator against synthetic plants: learning, non-negativity, margin coverage, plant change."""

from __future__ import annotations

import random

from controller.estimator import N, PeakEstimator
from telemetry.record import StepShape


def random_shape(rng: random.Random, prefill: bool | None = None) -> StepShape:
    prefill = rng.random() < 0.4 if prefill is None else prefill
    ds = rng.randint(0, 64)
    ps = rng.randint(1, 4) if prefill else 0
    pt = sum(rng.randint(16, 2048) for _ in range(ps))
    ctx = rng.randint(64, 4096)
    sc = ds * ctx + pt
    pa = pt * (pt // max(ps, 1) + rng.randint(0, 2048)) if prefill else 0
    return StepShape(
        prefill_tokens=pt,
        prefill_seqs=ps,
        decode_seqs=ds,
        sum_context=sc,
        max_context=ctx,
        prefill_attn=pa,
        sampled_seqs=ds + ps,
    )


class Plant:
    """peak (MiB) = base + a*prefill_tokens + b*prefill_seqs + c*decode_seqs + d*sum_context, x noise."""

    def __init__(self, scale: float = 1.0, noise: float = 0.02, seed: int = 1) -> None:
        self.scale, self.noise = scale, noise
        self.rng = random.Random(seed)

    def exact(self, s: StepShape) -> float:
        return self.scale * (
            4.0 + 0.5 * s.prefill_tokens + 40.0 * s.prefill_seqs + 0.5 * s.decode_seqs + 0.002 * s.sum_context
        )

    def __call__(self, s: StepShape) -> float:
        return self.exact(s) * (1.0 + self.noise * self.rng.random())


def train(est: PeakEstimator, plant: Plant, n: int, rng: random.Random) -> None:
    for _ in range(n):
        s = random_shape(rng)
        est.update(s, plant(s))


def test_learns_a_linear_plant() -> None:
    rng, plant, est = random.Random(0), Plant(), PeakEstimator()
    train(est, plant, 300, rng)
    assert est.trained
    for _ in range(200):
        s = random_shape(rng, prefill=True)
        assert abs(est.predict(s) - plant.exact(s)) / plant.exact(s) < 0.05
    assert all(v >= 0 for v in est.theta)
    c = est.coefficients()
    assert abs(c["prefill_tokens"] / (1 << 20) - 0.5) < 0.05


def test_coefficients_stay_non_negative_and_do_not_drift() -> None:
    """A plant that only costs per token; identical decode steps must not walk the prediction away (the
    failure of plain clipping with correlated features)."""
    est = PeakEstimator()
    rng = random.Random(2)
    for _ in range(200):
        s = random_shape(rng)
        est.update(s, 0.5 * (s.prefill_tokens + s.decode_seqs))
        assert min(est.theta) >= 0.0
    decode = StepShape(decode_seqs=3, sum_context=12000, max_context=4000, sampled_seqs=3)
    for _ in range(500):
        est.update(decode, 1.5)
        assert min(est.theta) >= 0.0
    assert abs(est.predict(decode) - 1.5) < 1.0
    assert est.resets <= 1


def test_margin_covers_fresh_steps() -> None:
    """The bound (prediction + margin) must cover all but a few percent of new steps of the same plant."""
    rng, plant, est = random.Random(3), Plant(noise=0.05), PeakEstimator()
    train(est, plant, 400, rng)
    misses = 0
    n = 1000
    for _ in range(n):
        s = random_shape(rng)
        y = plant(s)
        misses += y > est.bound(est.predict(s), s.prefill_tokens > 0)
        est.update(s, y)
    assert misses / n < 0.03


def test_relearns_after_the_plant_doubles() -> None:
    rng, est = random.Random(4), PeakEstimator()
    train(est, Plant(), 400, rng)
    doubled = Plant(scale=2.0, seed=5)
    errors = []
    for _ in range(60):
        s = random_shape(rng, prefill=True)
        y = doubled(s)
        errors.append(abs(est.predict(s) - doubled.exact(s)) / doubled.exact(s))
        est.update(s, y)
    assert est.resets >= 1
    settled = next(i for i in range(len(errors)) if max(errors[i:]) < 0.1)
    assert settled <= 15, errors[:20]
    # and the margin went cold (conservative) right after the change
    assert est.relative_margin(True) >= 0.0


def test_covariance_is_bounded_through_long_decode_stretches() -> None:
    rng, plant, est = random.Random(6), Plant(noise=0.0), PeakEstimator()
    train(est, plant, 200, rng)
    decode = StepShape(decode_seqs=8, sum_context=8000, max_context=1000, sampled_seqs=8)
    for _ in range(5000):
        est.update(decode, plant(decode))
    trace = sum(est.P[i][i] for i in range(N))
    assert trace <= est.prior_variance * N * 1.01
    s = StepShape(
        prefill_tokens=1024, prefill_seqs=1, sum_context=1024, max_context=1024, prefill_attn=1 << 20, sampled_seqs=1
    )
    assert abs(est.predict(s) - plant.exact(s)) / plant.exact(s) < 0.2
    est.update(s, plant(s))
    assert abs(est.predict(s) - plant.exact(s)) / plant.exact(s) < 0.1


def test_censored_update_resets_and_raises_the_estimate() -> None:
    rng, plant, est = random.Random(7), Plant(), PeakEstimator()
    train(est, plant, 200, rng)
    s = StepShape(prefill_tokens=2048, prefill_seqs=1, sum_context=2048, max_context=2048, sampled_seqs=1)
    before = est.predict(s)
    est.update(s, 2.0 * before, censored=True)
    assert est.resets >= 1
    assert est.predict(s) > 1.5 * before
