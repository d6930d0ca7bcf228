"""The KV pool size: the last static cap, set by the controller from the memory it measures. The adaptive
policy's pool rules (engine/core/kv/sizing.py profiles the start-up steps and the engine resizes).

Once every step's peak is bounded by the budget, memory that a hand-set pool keeps free for unbounded
prefills can hold KV instead. The pool is sized so that, beside it, the device keeps

    capacity - external - idle - headroom >= reserve

where idle includes the pool itself and `reserve` is what a profiling step of `pool_reserve_tokens`
prompt tokens measured above idle at start-up (two back-to-back steps, so what the first leaves
allocated into the second counts, as vLLM's and TGI's profile runs do with their largest step). The
budget's parts come from the probes as for admission (controller/budget.py); `room` is the left side
minus the reserve, in bytes:

- room < 0: memory got tight (another process took some, or the idle footprint grew): shrink at once by
  the blocks it takes to restore the reserve, before the next step is packed, giving back free blocks
  only; the budget then bounds steps as usual, out of the reserve. Only when the shortfall is larger than
  the whole reserve (the pool itself no longer fits beside idle and headroom) does the pool have to reach
  its `must_reach` (controller/policy.py PoolTarget) even below the blocks in use: the engine preempts the
  newest running sequences by recompute until it can, the last resort, since steps would otherwise OOM.
- room >= one block plus `pool_hysteresis_mib`, for `pool_grow_hold` consecutive decisions: grow by the
  whole room. After a grow the room sits in [0, one block), inside the band, so nothing oscillates.
- at most one resize per `pool_cooldown` steps, shrinks for tight memory excepted.
External usage is the budget's recent maximum (a window of sampled steps), so a pool grows back only
after the other process's memory has been gone for that window: late, never early.

The reserve follows demand (`note_demand`, after each step). One fixed reserve trades prefill room against
KV: a small one starves prefills where KV never binds ((16, 256, 256) on the twin), a large one starves KV
where it binds (the out=4096 points). So the pool keeps the profiled reserve while KV is not the limit, and
lowers it to `pool_min_reserve_tokens` worth (the profiled bytes scaled by tokens: the reserve is logits
and activations, linear in the prompt tokens of the step) when a step preempts for lack of blocks; the
room this frees is then grown into by the ordinary grow rule. It returns to the profiled reserve when a
prefill is cut for memory while enough blocks stand spare to give it back, and `pool_cooldown` steps have
passed with no preemption; the shrink then takes free blocks only. Spare, not free: blocks that a chunked
prefill (often the recompute of a preempted sequence) is about to fill, or that queued requests need for
their prompts, are free for a moment but not room KV can spare. Counting them as spare flipped the reserve
back in the middle of each recompute at the KV-bound points, the pool shrank 111 -> 87 blocks, the next
decode preempted again, and the pool grew back: at (4, 4096, 4096) on the twin a cycle every ~50 steps
(bench/results/kv_pressure.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from controller.budget import BudgetTracker
from controller.config import ControllerConfig
from controller.decisions import Decision
from controller.policy import PoolProfile, PoolResize, PoolTarget
from telemetry.record import MemorySample
from telemetry.units import MIB

START_UP = "start-up sizing"


@dataclass(frozen=True, slots=True)
class StartUpSizing:
    """The parts of the start-up size, bytes (GET /controller/state `kv_pool.start_up`)."""

    profiled_tokens: int
    profile_steps: int
    capacity: int
    external: int
    idle_without_pool: int
    headroom: int
    reserve: int
    block_bytes: int
    num_blocks: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PoolSizer:
    """The pool's size over the policy's budget (shared with admission: a resize moves its idle floor)."""

    def __init__(self, cfg: ControllerConfig, budget: BudgetTracker) -> None:
        self.cfg = cfg
        self.budget = budget
        self.block_bytes = 0  # 0: the pool is not ours to size (a fixed --num-blocks, or a static policy)
        self.full_reserve = 0  # what the profiling step measured
        self.kv_bound = False  # demand: True while KV binds (the reserve is lowered)
        self._last_preemption_step = -(1 << 62)
        self.num_blocks = 0
        self.start_up: StartUpSizing | None = None
        self.resizes = 0
        self.failed = 0
        self._room_decisions = 0
        self._last_resize_step = -(1 << 62)

    def configure(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return self.block_bytes > 0

    @property
    def pool_bytes(self) -> int | None:
        """The pool's bytes while it is ours to size."""
        return self.num_blocks * self.block_bytes if self.enabled else None

    def profile(self) -> PoolProfile:
        """The largest prefill the pool must leave room for, and the largest decode batch the law may run."""
        return PoolProfile(self.cfg.pool_reserve_tokens, self.cfg.max_decode_seqs)

    def start(self, num_blocks: int, block_bytes: int, reserve: int) -> None:
        self.num_blocks, self.block_bytes, self.full_reserve = num_blocks, block_bytes, max(0, reserve)

    def size_at_start(
        self, num_blocks: int, block_bytes: int, samples: list[MemorySample]
    ) -> tuple[PoolTarget, Decision]:
        """Take over the pool of `num_blocks` blocks that the profiling steps' `samples` were measured with:
        the reserve is their largest step above idle, the size what the room beside it holds."""
        b = self.budget
        for m in samples:
            b.observe(m)
        idle = b.idle_floor or 0
        reserve = max(max(m.peak_allocated, m.reserved) - idle for m in samples)
        self.start(num_blocks, block_bytes, reserve)
        target = max(1, num_blocks + self.blocks_for_room(self.room(samples[-1])))
        external = b.external_at(samples[-1])
        self.start_up = StartUpSizing(
            self.cfg.pool_reserve_tokens,
            len(samples),
            b.capacity,
            external,
            idle - num_blocks * block_bytes,
            b.headroom(),
            reserve,
            block_bytes,
            target,
        )
        return PoolTarget(target, START_UP), Decision(
            "kv_pool_size",
            f"start-up: {target} blocks of {block_bytes / MIB:.1f} MiB beside a "
            f"{reserve / MIB:.0f} MiB reserve (profiled {self.cfg.pool_reserve_tokens}-token prefill), "
            f"{b.headroom() / MIB:.0f} MiB headroom, {external / MIB:.0f} MiB outside",
        )

    def room(self, m: MemorySample) -> int:
        """Bytes beside the pool and the reserve as of sample `m` (negative: short), so memory another
        process took since the last step counts."""
        b = self.budget
        if b.idle_floor is None:
            return 0
        return int(b.capacity - b.external_at(m) - b.idle_floor - b.headroom() - self.reserve)

    @property
    def reserve(self) -> float:
        """Bytes the pool leaves beside itself for prefills now: the profiled reserve, or its share for
        `pool_min_reserve_tokens` while KV binds."""
        if not self.kv_bound:
            return self.full_reserve
        return self.full_reserve * min(1.0, self.cfg.pool_min_reserve_tokens / self.cfg.pool_reserve_tokens)

    def note_demand(self, step: int, preempted: int, prefill_cut: bool, spare_blocks: int) -> str | None:
        """After each step: switch the reserve to follow what binds; returns why when it switched.
        `spare_blocks`: free blocks that no queued work needs for the tokens it has (StepRecord.kv_blocks_owed)."""
        if preempted:
            self._last_preemption_step = step
            if not self.kv_bound:
                self.kv_bound = True
                return f"KV binds ({preempted} preempted): reserve lowered to {self.reserve / MIB:.0f} MiB"
            return None
        give_back = -(-(self.full_reserve - self.reserve) // self.block_bytes)
        if (
            self.kv_bound
            and prefill_cut
            and spare_blocks >= give_back
            and step - self._last_preemption_step >= self.cfg.pool_cooldown
        ):
            self.kv_bound = False
            return (
                f"prefill cut for memory with {spare_blocks} blocks spare: reserve back to {self.reserve / MIB:.0f} MiB"
            )
        return None

    def blocks_for_room(self, room: int) -> int:
        """Blocks that `room` bytes hold (negative room: minus the blocks it takes to cover it)."""
        return room // self.block_bytes

    def decide(self, step: int, room: int) -> PoolTarget | None:
        """The pool decision for `room` bytes beside the pool and the reserve, or None to keep the pool."""
        if room < 0:
            target = max(1, self.num_blocks + self.blocks_for_room(room))
            if target >= self.num_blocks:
                return None
            self._room_decisions = 0
            beyond_reserve = room + int(self.reserve)
            must_reach = max(1, self.num_blocks + self.blocks_for_room(beyond_reserve)) if beyond_reserve < 0 else None
            why = f"memory tight: {-room / MIB:.0f} MiB short of the {self.reserve / MIB:.0f} MiB reserve"
            return PoolTarget(target, why, must_reach)
        if room < self.block_bytes + self.cfg.pool_hysteresis_mib * MIB:
            self._room_decisions = 0
            return None
        self._room_decisions += 1
        if self._room_decisions < self.cfg.pool_grow_hold or step - self._last_resize_step < self.cfg.pool_cooldown:
            return None
        self._room_decisions = 0
        return PoolTarget(
            self.num_blocks + self.blocks_for_room(room),
            f"headroom persisted: {room / MIB:.0f} MiB above the reserve for {self.cfg.pool_grow_hold} decisions",
        )

    def resized(self, step: int, resize: PoolResize) -> list[Decision]:
        """Take in what came of a decision (the engine's PoolResize); returns the decisions to log. The
        budget's idle floor follows a resize at once."""
        old, new, why = resize.old, resize.new, resize.target.reason
        decisions = []
        if resize.preempted:
            decisions.append(
                Decision(
                    "kv_pool_preempt",
                    f"{resize.preempted} newest running sequences preempted by recompute: the pool "
                    f"({old} blocks) must shrink below the blocks in use ({why})",
                )
            )
            if demand := self.note_demand(step, resize.preempted, False, 0):
                decisions.append(Decision("kv_pool_demand", demand))
        self._last_resize_step = step
        if resize.error is not None:
            self.failed += 1
            return [*decisions, Decision("kv_pool_failed", f"resize {old} -> ? blocks failed: {resize.error}")]
        self.resizes += new != self.num_blocks
        self.num_blocks = new
        if resize.changed:
            self.budget.shift_idle((new - old) * self.block_bytes)
            decisions.append(
                Decision("kv_pool_grow" if new > old else "kv_pool_shrink", f"{old} -> {new} blocks: {why}")
            )
        return decisions

    def state(self) -> dict[str, Any]:
        return {
            "sized": self.enabled,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "pool_bytes": self.num_blocks * self.block_bytes,
            "reserve_bytes": int(self.reserve),
            "profiled_reserve_bytes": self.full_reserve,
            "kv_bound": self.kv_bound,
            "resizes": self.resizes,
            "failed_resizes": self.failed,
            "start_up": None if self.start_up is None else self.start_up.as_dict(),
        }
