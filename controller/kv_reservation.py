"""KV reservation ratio: the share of each request's not-yet-generated max_tokens reserved at admission.

The rule is SGLang's new_token_ratio: start at `kv_ratio_init`, decay linearly per decode step to a
floor, jump up when decode runs out of KV and sequences are preempted. Why not reserve everything (ratio
1, like the seed and TGI): running requests are at different points of their output, so the pool holds
far more of them than their worst cases add up to; a low ratio admits them, and preemption (recompute)
is the price. The defaults start at vLLM's prompt-only reservation (ratio 0, no jump): on the twin's
matrix recompute is cheap next to the decode steps a fuller batch wins, and SGLang's 0.7/0.1/0.2 lost
throughput at every KV-bound point but one. Two additions:
- churn cap: preemptions are counted in an exponentially weighted rate (per 1000 steps); while the rate
  exceeds `kv_churn_max` the floor itself rises by `kv_floor_step` per preemption step, so a workload
  whose requests do all grow to max_tokens stops thrashing; the floor relaxes back slowly once clean.
- output lengths: when the engine reports finished requests (`observe_finished`), the ratio never sits
  above the mean share of max_tokens that requests really generate (while churn is low), since
  reserving more than a request will use only keeps others out.
"""

from __future__ import annotations

from controller.config import ControllerConfig

_RATE_WINDOW = 1000.0  # steps: the time constant of the churn rate


class KVReservation:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.ratio = cfg.kv_ratio_init
        self.floor = cfg.kv_ratio_floor
        self.churn = 0.0  # preemptions per 1000 steps, exponentially weighted
        self.preemptions = 0
        self.used_share: float | None = None  # mean output_len / max_tokens of finished requests
        self.finished = 0

    def configure(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.floor = min(1.0, max(cfg.kv_ratio_floor, self.floor))
        self.ratio = min(1.0, max(self.floor, self.ratio))

    @property
    def decay(self) -> float:
        return 1.0 / self.cfg.kv_ratio_decay_steps

    def observe(self, preempted: int, decode_seqs: int) -> str | None:
        """One step: decay on decode steps, jump on preemption. Returns a reason when the ratio jumped."""
        cfg = self.cfg
        self.churn += (preempted * 1000.0 - self.churn) / _RATE_WINDOW
        if preempted:
            self.preemptions += preempted
            if self.churn > cfg.kv_churn_max:
                self.floor = min(1.0, self.floor + cfg.kv_floor_step)
            old = self.ratio
            self.ratio = min(1.0, max(self.floor, self.ratio + cfg.kv_ratio_jump))
            return (
                f"{preempted} preempted (churn {self.churn:.1f}/1000 steps): reservation ratio "
                f"{old:.3f} -> {self.ratio:.3f}, floor {self.floor:.3f}"
            )
        if self.floor > cfg.kv_ratio_floor and self.churn < 0.5 * cfg.kv_churn_max:
            self.floor = max(cfg.kv_ratio_floor, self.floor - self.decay)
        if decode_seqs:
            self.ratio = max(self.floor, self.ratio - self.decay)
        if self.used_share is not None and self.churn < 0.5 * cfg.kv_churn_max:
            self.ratio = max(self.floor, min(self.ratio, self.used_share))
        return None

    def observe_finished(self, output_len: int, max_tokens: int) -> None:
        """A request finished after `output_len` of its `max_tokens`."""
        if max_tokens <= 0:
            return
        share = min(1.0, output_len / max_tokens)
        self.finished += 1
        if self.used_share is None:
            self.used_share = share
        else:
            self.used_share += (share - self.used_share) / min(self.finished, 100)

    def state(self) -> dict:
        return {
            "ratio": self.ratio,
            "floor": self.floor,
            "churn_per_1000_steps": self.churn,
            "preemptions": self.preemptions,
            "used_share": self.used_share,
        }
