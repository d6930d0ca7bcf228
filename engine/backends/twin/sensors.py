"""The twin's sensors: what the probe can know of device memory, and the memory a real process holds outside
the per-step allocator trace (`--twin-sensors`).

`ideal` reports the modelled bytes exactly at every step. `realistic` reports them as a card would:
- NVML's used bytes are device-wide and read by Headroom's probe at most every `nvml_period_s` (at a step's
  end, `telemetry/probes/nvml.py`), then held. A reading taken before an `empty_cache` still counts the bytes
  it gave back until the next read; the probe reports a held reading with the allocator's reserved bytes of
  its read, so the controller does not take those bytes for memory outside its allocator (controller/budget.py);
- decode CUDA graphs are captured on first use of their batch bucket (`engine/model/cuda_graphs.py`) into
  one private pool, and each capture's warm-up stream gets its own cuBLAS workspace. Both take driver memory
  after start-up, both count in the allocator's reserved bytes (PyTorch counts private-pool segments and the
  workspaces it allocates through the caching allocator), and a KV resize drops the graphs.

Every constant comes from the profile's [sensors] section, labelled there as fact or hypothesis.
"""

from __future__ import annotations

from bisect import bisect_left

from engine.backends.twin.memory import block_round, segment_size
from engine.backends.twin.profile import Profile


class NvmlSensor:
    """NVML's used bytes as the probe reports them. `period` None: exact at every reading (ideal). Otherwise a
    reading at a step's end goes to the driver only when `period` seconds have passed since the last one
    (NvmlProbe.read), and every other reading returns the value held since, with the allocator's reserved
    bytes of the moment it was read (what CudaProbe reports beside a held reading, MemorySample)."""

    def __init__(self, period: float | None, used: int, reserved: int) -> None:
        self.period = period
        self.value = used  # the probe's first value (CudaProbe reads mem_get_info at construction)
        self.reserved = reserved  # the allocator's reserved bytes when `value` was read
        self.read_at: float | None = None  # NvmlProbe's first read() always goes to the driver
        self.reads = 0

    def at(self, now: float | None, used: int, reserved: int) -> tuple[int, int | None]:
        """The reported used bytes when the device holds `used` and the allocator `reserved`: read at `now` (a
        step's end), or between steps (None), where the probe makes no driver call. Second: the reserved bytes
        the reading was taken beside when it is held from earlier (None: read now)."""
        if self.period is None:
            return used, None
        if now is not None and (self.read_at is None or now - self.read_at >= self.period):
            self.value, self.reserved, self.read_at = used, reserved, now
            self.reads += 1
            return used, None
        return self.value, self.reserved


class LazyMemory:
    """CUDA graph pools and cuBLAS workspaces: memory taken after start-up, outside the step trace.

    Captures share one private pool: a capture reuses what earlier captures freed, so the pool holds the
    largest working set captured (in its cudaMalloc'd segment) plus every captured graph's output. The
    compute stream has a workspace from start-up; each capture draws a fresh warm-up stream from PyTorch's
    round-robin stream pool (and the first also the graph capture stream), and a stream's workspace lives as
    long as the process."""

    def __init__(self, section: dict) -> None:
        self.buckets = tuple(sorted(int(b) for b in section["graph_buckets"]))
        self.work_row = int(section["graph_work_row_bytes"])
        self.output_row = int(section["graph_output_row_bytes"])
        self.workspace = int(section["cublas_workspace_bytes"])
        self.stream_pool = int(section["stream_pool_size"])
        self.captured: frozenset[int] = frozenset()
        self.draws = 0  # streams drawn from the pool so far
        self.disabled = False  # a capture failed: decode runs eagerly from then on (cuda_graphs.py)

    @classmethod
    def from_profile(cls, profile: Profile) -> LazyMemory:
        return cls(profile.section("sensors"))

    def bucket(self, n: int) -> int | None:
        """The bucket a decode step of `n` replays; None when it runs eagerly (too large, or graphs off)."""
        i = bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) and not self.disabled else None

    def needs_capture(self, n: int) -> bool:
        b = self.bucket(n)
        return b is not None and b not in self.captured

    def _outputs(self, captured: frozenset[int]) -> int:
        return sum(block_round(b * self.output_row) for b in captured)

    def _pool(self, captured: frozenset[int]) -> int:
        if not captured:
            return 0
        return segment_size(max(captured) * self.work_row) + self._outputs(captured)

    def _workspaces(self, draws: int) -> int:
        return self.workspace * (1 + min(draws, self.stream_pool))

    def _draws_after_capture(self) -> int:
        return self.draws + (2 if self.draws == 0 else 1)  # the first capture also makes the capture stream

    def capture_growth(self, n: int) -> int:
        """Driver bytes the capture of `n`'s bucket takes (pool growth and new streams' workspaces)."""
        after = self._pool(self.captured | {self.bucket(n)}) + self._workspaces(self._draws_after_capture())
        return after - self.reserved

    def capture(self, n: int) -> None:
        self.captured = self.captured | {self.bucket(n)}
        self.draws = self._draws_after_capture()

    def release_graphs(self) -> None:
        """A KV resize replaces the tensors the graphs captured: they are dropped, their pool goes back to the
        driver (the backend empties the cache after a resize), and buckets are captured again on first use."""
        self.captured = frozenset()

    @property
    def reserved(self) -> int:
        """Bytes held from the driver: the graph pool and every workspace."""
        return self._pool(self.captured) + self._workspaces(self.draws)

    @property
    def allocated(self) -> int:
        """Of those, bytes live in the allocator's stats: the workspaces and the graphs' outputs (a graph's
        intermediates are free blocks of its pool)."""
        return self._outputs(self.captured) + self._workspaces(self.draws)
