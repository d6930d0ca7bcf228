"""The control law: how the budget scale and the batch caps move with the measured error.

Two actuators, two jobs:
- `scale` (0 < scale <= 1) multiplies the usable budget that admission packs steps against. It backs off
  multiplicatively (fast) when a measured peak comes past the setpoint (peak > backoff_threshold *
  usable), optionally when the allocator had to flush its cache and retry (`retry_backoff`; off by
  default: a caching allocator flushes routinely near its limit, which is not yet danger), and hard on an
  OOM; it recovers additively (slow) after
  `recovery_hold` clean steps, and only on steps that admission actually limited (anti-windup: no credit
  is banked while the budget is not what limits the batch) and whose peak sat below recover_below *
  usable (the band between the two thresholds is the hysteresis: inside it nothing moves).
- the caps (`prefill_tokens`, `decode_seqs`) are a trust region for the estimator: a batch may grow to at
  most `slow_start_growth` times the largest batch that has run cleanly, so the model never extrapolates
  far from what it has seen (cold start: a small prefill budget that doubles per clean step, like TCP
  slow start). After the first backoff they grow additively (congestion avoidance) and only when the
  cap itself was what limited the step.
Rate limits: at most one near-miss backoff per `backoff_cooldown` steps (one overshoot is one event, not
one per step that still carries it), recovery at most `recovery_step` per step. An OOM raises the
emergency flag for `emergency_steps` steps, during which nothing grows.
"""

from __future__ import annotations

from controller.config import ControllerConfig
from controller.decisions import Decision


class ControlLaw:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.scale = 1.0
        self.prefill_cap = cfg.cold_prefill_tokens
        self.decode_cap = cfg.cold_decode_seqs
        self.slow_start = True
        self.last_backoff_step = -(1 << 62)
        self.clean_steps = 0
        self.emergency_until = -1
        self.step = -1
        self.backoffs = 0
        self.oom_backoffs = 0
        self.recoveries = 0

    def configure(self, cfg: ControllerConfig) -> None:
        """New gains; state is kept but clamped into the new bounds."""
        self.cfg = cfg
        self.scale = min(1.0, max(cfg.min_scale, self.scale))
        self.prefill_cap = min(cfg.max_prefill_tokens, max(cfg.min_chunk, self.prefill_cap))
        self.decode_cap = min(cfg.max_decode_seqs, max(1, self.decode_cap))

    @property
    def emergency(self) -> bool:
        return self.step < self.emergency_until

    def observe(
        self,
        step: int,
        peak_mib: float | None,
        usable_mib: float | None,
        oom: bool,
        alloc_retry: bool,
        prefill_tokens: int,
        decode_seqs: int,
        memory_bound: bool,
    ) -> list[Decision] | None:
        """One step's feedback. `peak_mib` is None when the step was not sampled; `memory_bound` is True
        when admission cut a chunk or deferred work on the step. Returns the events, if any."""
        cfg = self.cfg
        self.step = step
        events: list[Decision] | None = None
        if oom:
            return [self._oom(prefill_tokens, decode_seqs)]
        near = peak_mib is not None and usable_mib is not None and peak_mib > cfg.backoff_threshold * usable_mib
        retry = alloc_retry and cfg.retry_backoff < 1.0
        if near or retry:
            if step - self.last_backoff_step >= cfg.backoff_cooldown:
                self._backoff(cfg.backoff if near else cfg.retry_backoff, prefill_tokens, decode_seqs, hard=False)
                why = (
                    f"peak {peak_mib:.0f} MiB > {cfg.backoff_threshold:.2f} x usable {usable_mib:.0f} MiB"
                    if near
                    else "allocator retry (cache flush)"
                )
                return [Decision("backoff", f"{why}: scale -> {self.scale:.3f}")]
            self.clean_steps = 0
            return None
        self.clean_steps += 1
        if self.emergency:
            return None
        # additive recovery of the scale, anti-windup and hysteresis
        if (
            self.scale < 1.0
            and memory_bound
            and self.clean_steps > cfg.recovery_hold
            and peak_mib is not None
            and usable_mib is not None
            and peak_mib < cfg.recover_below * usable_mib
        ):
            self.scale = min(1.0, self.scale + cfg.recovery_step)
            self.recoveries += 1
            if self.scale >= 1.0:
                events = [Decision("recovered", "scale back to 1.0 after clean memory-bound steps")]
        # caps: trust region over the largest clean batch
        if peak_mib is not None or not self.slow_start:
            self._grow_caps(prefill_tokens, decode_seqs)
        return events

    def _oom(self, prefill_tokens: int, decode_seqs: int) -> Decision:
        """A hard backoff, and no growth for emergency_steps."""
        self._backoff(self.cfg.oom_backoff, prefill_tokens, decode_seqs, hard=True)
        self.emergency_until = self.step + self.cfg.emergency_steps
        self.oom_backoffs += 1
        return Decision(
            "oom_backoff",
            f"OOM on a step of {prefill_tokens} prefill tokens and {decode_seqs} decodes: scale -> "
            f"{self.scale:.3f}, prefill cap -> {self.prefill_cap}, decode cap -> {self.decode_cap}",
        )

    def _grow_caps(self, prefill_tokens: int, decode_seqs: int) -> None:
        cfg = self.cfg
        if self.slow_start:
            if prefill_tokens:
                self.prefill_cap = max(
                    self.prefill_cap, min(cfg.max_prefill_tokens, int(cfg.slow_start_growth * prefill_tokens))
                )
            if decode_seqs:
                self.decode_cap = max(
                    self.decode_cap, min(cfg.max_decode_seqs, int(cfg.slow_start_growth * decode_seqs))
                )
            return
        if self.clean_steps <= cfg.recovery_hold:
            return
        if prefill_tokens >= 0.9 * self.prefill_cap:
            self.prefill_cap = min(cfg.max_prefill_tokens, self.prefill_cap + cfg.cap_recovery_tokens)
        if decode_seqs >= self.decode_cap:
            self.decode_cap = min(cfg.max_decode_seqs, self.decode_cap + cfg.cap_recovery_seqs)

    def _backoff(self, factor: float, prefill_tokens: int, decode_seqs: int, hard: bool) -> None:
        cfg = self.cfg
        self.scale = max(cfg.min_scale, self.scale * factor)
        self.last_backoff_step = self.step
        self.clean_steps = 0
        self.slow_start = False
        self.backoffs += 1
        if not hard:
            return
        # An OOM: the trust region shrinks below the batch that failed.
        if prefill_tokens > 0:
            self.prefill_cap = max(cfg.min_chunk, int(min(self.prefill_cap, prefill_tokens) * factor))
        else:
            self.decode_cap = max(1, int(min(self.decode_cap, max(decode_seqs, 1)) * factor))

    def state(self) -> dict:
        return {
            "scale": self.scale,
            "prefill_cap": self.prefill_cap,
            "decode_cap": self.decode_cap,
            "mode": "slow_start" if self.slow_start else "avoidance",
            "emergency": self.emergency,
            "clean_steps": self.clean_steps,
        }
