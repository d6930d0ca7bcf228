"""The memory budget of one step: usable = capacity - idle - setpoint headroom.

Capacity and idle come from the probes in the step records, never from config: the device knows its
size, and the idle baseline (weights, KV pool, workspaces) changes with the model, the backend and the
KV pool size. Where the device also reports its used and total bytes (NVML), memory held outside the
allocator (other processes, CUDA context, NCCL) tightens the capacity; it can only ever tighten it.
"""

from __future__ import annotations

from dataclasses import dataclass

from telemetry.record import MemorySample

MIB = float(1 << 20)


@dataclass(frozen=True)
class Budget:
    """Budget parts in bytes. `known` is False until a sampled record has arrived."""

    capacity: int = 0
    idle: int = 0
    headroom: int = 0
    external: int = 0  # bytes held outside the allocator that also cut the capacity
    known: bool = False

    @property
    def free(self) -> int:
        """Bytes a step may add above idle before the allocator runs out."""
        return max(0, self.capacity - self.external - self.idle)

    @property
    def usable(self) -> int:
        """Bytes a step may add above idle while keeping the setpoint headroom."""
        return max(0, self.free - self.headroom)

    @property
    def usable_mib(self) -> float:
        return self.usable / MIB

    @property
    def free_mib(self) -> float:
        return self.free / MIB

    def as_dict(self) -> dict:
        return {
            "known": self.known,
            "capacity": self.capacity,
            "idle": self.idle,
            "external": self.external,
            "headroom": self.headroom,
            "free": self.free,
            "usable": self.usable,
        }


class BudgetTracker:
    """Keeps the latest budget from sampled memory records."""

    def __init__(self, headroom_frac: float, headroom_min_mib: float, use_device_used: bool = True) -> None:
        self.headroom_frac = headroom_frac
        self.headroom_min = headroom_min_mib * MIB
        self.use_device_used = use_device_used
        self.budget = Budget()

    def configure(self, headroom_frac: float, headroom_min_mib: float, use_device_used: bool) -> None:
        self.headroom_frac = headroom_frac
        self.headroom_min = headroom_min_mib * MIB
        self.use_device_used = use_device_used
        b = self.budget
        if b.known:
            self.budget = Budget(b.capacity, b.idle, self._headroom(b.capacity), b.external, True)

    def _headroom(self, capacity: int) -> int:
        return int(max(self.headroom_frac * capacity, self.headroom_min))

    def observe(self, m: MemorySample) -> Budget:
        """Update from a memory sample; stale (unsampled) or empty samples leave the budget unchanged."""
        if not m.sampled or m.capacity <= 0:
            return self.budget
        external = 0
        if self.use_device_used and m.device_used is not None and m.device_total:
            # Bytes the device uses that the allocator does not hold: context, other processes.
            outside = m.device_used - max(m.reserved, m.peak_allocated)
            if 0 < outside < m.device_total:
                limit = m.device_total - outside
                external = max(0, m.capacity - limit)  # only when it tightens the capacity
        b = self.budget
        if (b.known and b.capacity == m.capacity and b.idle == m.idle_baseline
                and b.external == external):
            return b
        self.budget = Budget(m.capacity, m.idle_baseline, self._headroom(m.capacity), external, True)
        return self.budget
