"""The memory budget of the next step: usable = capacity - external - idle - retained - headroom.

All parts come from the probes in the step records, never from config: the device knows its size, and
the idle footprint (weights, KV pool, workspaces) changes with the model, the backend and the pool size.
- capacity: what the allocator may ever use (torch total_memory, or the emulated size);
- external: bytes the device holds outside the allocator (CUDA context, NCCL, other processes), seen as
  device_used minus the allocator's reserved bytes of the same moment (a held NVML reading is paired with
  those of its read, see _outside_of); the largest recent value counts (a cache flush can hide it for a step).
  The least value ever seen (`external_floor`) is what never lets go: admission refuses a request only
  against that, since memory another process holds now may come back;
- idle: the allocator's floor between steps (lowest idle baseline seen);
- retained: what the previous step leaves allocated into the next one above that floor (e.g. an engine
  that keeps the last logits referenced). It is not known when the next step is packed, so the policy
  predicts it from the last step's shape (`retained` argument of `next_budget`);
- headroom: the setpoint, max(frac * capacity, min), covering allocator fragmentation and model error.
"""

from __future__ import annotations

from collections import deque

from telemetry.record import MemorySample
from telemetry.units import MIB

_EXTERNAL_WINDOW = 256  # sampled steps over which the largest outside-allocator usage counts


class Budget:
    """Budget parts in bytes (immutable by convention; a new one is made per step). `known` is False until
    a sampled record has arrived. A plain slotted class: admission reads it every step and a frozen
    dataclass costs several microseconds to build."""

    __slots__ = (
        "capacity",
        "external",
        "idle",
        "retained",
        "headroom",
        "known",
        "free",
        "usable",
        "free_mib",
        "usable_mib",
    )

    def __init__(
        self,
        capacity: int = 0,
        external: int = 0,
        idle: int = 0,
        retained: int = 0,
        headroom: int = 0,
        known: bool = False,
    ) -> None:
        self.capacity, self.external, self.idle = capacity, external, idle
        self.retained, self.headroom, self.known = retained, headroom, known
        free = capacity - external - idle - retained
        free = free if free > 0 else 0
        usable = free - headroom
        usable = usable if usable > 0 else 0
        self.free = free  # bytes the next step may add before the allocator runs out
        self.usable = usable  # ... while keeping the setpoint headroom
        self.free_mib = free / MIB
        self.usable_mib = usable / MIB

    def as_dict(self) -> dict:
        return {
            "known": self.known,
            "capacity": self.capacity,
            "external": self.external,
            "idle": self.idle,
            "retained": self.retained,
            "headroom": self.headroom,
            "free": self.free,
            "usable": self.usable,
        }


class BudgetTracker:
    """Capacity, external usage and the idle floor from sampled memory records."""

    def __init__(self, headroom_frac: float, headroom_min_mib: float, use_device_used: bool = True) -> None:
        self.headroom_frac = headroom_frac
        self.headroom_min = headroom_min_mib * MIB
        self.use_device_used = use_device_used
        self.capacity = 0
        self.idle_floor: int | None = None
        # sliding-window maximum of the outside-allocator bytes: a monotonic deque of (sample, bytes)
        self._outside: deque[tuple[int, int]] = deque()
        self._n = 0
        self._external = 0
        self._floor: int | None = None  # the least outside-allocator bytes seen
        self.budget = Budget()

    def configure(self, headroom_frac: float, headroom_min_mib: float, use_device_used: bool) -> None:
        self.headroom_frac = headroom_frac
        self.headroom_min = headroom_min_mib * MIB
        self.use_device_used = use_device_used
        if not use_device_used:
            self._external = 0

    @property
    def external(self) -> int:
        return self._external

    @property
    def external_floor(self) -> int:
        """The least memory ever seen outside the allocator: the CUDA context and whatever else has held its
        bytes all along. What is above it now another process holds, and may give back."""
        return self._floor or 0

    def free_now(self, m: MemorySample) -> float:
        """MiB the step of sample `m` could add above its own idle baseline (known after the fact)."""
        return (self.capacity - self._external - m.idle_baseline) / MIB

    def headroom(self) -> int:
        h = self.headroom_frac * self.capacity
        return int(h if h > self.headroom_min else self.headroom_min)

    def observe(self, m: MemorySample) -> int | None:
        """Learn from a memory sample; returns the bytes retained above the idle floor at the start of
        this step (None for stale or empty samples)."""
        if not m.sampled or m.capacity <= 0:
            return None
        if m.capacity != self.capacity:  # a new device (or emulated size): forget the old floor
            self.capacity = m.capacity
            self.idle_floor = None
            self._outside.clear()
            self._external = 0
            self._floor = None
        if self.idle_floor is None or m.idle_baseline < self.idle_floor:
            self.idle_floor = m.idle_baseline
        outside = self._outside_of(m)
        if outside is not None and 0 <= outside < m.capacity:
            q = self._outside
            self._n += 1
            while q and q[-1][1] <= outside:
                q.pop()
            q.append((self._n, outside))
            while q[0][0] <= self._n - _EXTERNAL_WINDOW:
                q.popleft()
            self._external = q[0][1]
            self._floor = outside if self._floor is None else min(self._floor, outside)
        return m.idle_baseline - self.idle_floor

    def _outside_of(self, m: MemorySample) -> int | None:
        """Device memory this sample says is held outside our allocator (None: it cannot tell, or not used).

        A device-wide reading is only comparable with the allocator's bytes of the same moment. The probe reads
        NVML at most every ~100 ms and holds the value between reads, while the allocator's stats are exact at
        every step; after an empty_cache (a pool shrink, a graph capture, a failed cudaMalloc's flush) a held
        reading still counts the bytes just given back. Subtracting this step's reserved bytes would call them
        another process's, the pool would shrink for them, and the window maximum would keep them for its whole
        length, starving every step of budget. So a held reading is paired with the reserved bytes it was read beside
        (`device_used_reserved`): its estimate is exact as of its read, only late, and memory another process
        takes meanwhile shows at the next read, as it would with no rate limit at all."""
        if self.use_device_used and m.device_used is not None and m.reserved > 0:
            paired = m.device_used_reserved
            return m.device_used - (m.reserved if paired is None else paired)
        return None

    def external_at(self, m: MemorySample) -> int:
        """Memory held outside the allocator as of `m`: the windowed estimate, or more if `m` already shows
        more (another process took memory since the last step)."""
        return max(self.external, self._outside_of(m) or 0)

    def shift_idle(self, delta: int) -> None:
        """The idle footprint moved by `delta` bytes (the KV pool was resized): the floor follows at once,
        and the budget with it, instead of waiting for a lower idle sample (a grow would never bring one)."""
        if self.idle_floor is None:
            return
        self.idle_floor += delta
        self.next_budget(self.budget.retained)

    def next_budget(self, retained: float) -> Budget:
        """The budget of the next step, given the bytes predicted to stay allocated from this one."""
        if self.idle_floor is None:
            return Budget()
        b, r = self.budget, int(retained) if retained > 0 else 0
        if (
            b.known
            and b.retained == r
            and b.capacity == self.capacity
            and b.external == self._external
            and b.idle == self.idle_floor
            and b.headroom == self.headroom()
        ):
            return b  # unchanged: keep the object (admission's precomputed thresholds stay valid)
        self.budget = Budget(self.capacity, self._external, self.idle_floor, r, self.headroom(), True)
        return self.budget
