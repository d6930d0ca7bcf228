"""The adaptive policy's side of KV pool sizing (controller/kv_pool.py decides; the engine resizes): the start-up
sizing from the profiling steps, the size to move to before each step, and what a resize changes."""

from __future__ import annotations

from controller.budget import MIB, BudgetTracker
from controller.config import ControllerConfig
from controller.kv_pool import PoolSizer
from telemetry.record import MemorySample


class PoolControl:
    """Mixin of AdaptivePolicy: the Policy protocol's pool methods over its budget and PoolSizer."""

    cfg: ControllerConfig
    budget: BudgetTracker
    pool: PoolSizer
    counters: dict[str, int]
    _step: int
    _pool_reason: str
    # and AdaptivePolicy's _log(action, reason) and _thresholds_moved()

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
        self._thresholds_moved()

    def _pool_room(self, m: MemorySample) -> int:
        b = self.budget
        if b.idle_floor is None:
            return 0
        return int(b.capacity - self.budget.external_at(m) - b.idle_floor - b.headroom() - self.pool.reserve)
