"""The twin's sensors: what the probe can know of device memory, and the memory a real process holds outside
the per-step allocator trace (`--twin-sensors`).

`ideal` reports the modelled bytes exactly at every step. `realistic` reports them as a card would:
- NVML's used bytes are device-wide and read by Headroom's probe at most every `nvml_period_s` (at a step's
  end, `telemetry/probes/nvml.py`), then held. A reading taken before an `empty_cache` still counts the bytes
  it gave back until the next read; the probe reports a held reading with the allocator's reserved bytes of
  its read, so the controller does not take those bytes for memory outside its allocator (controller/budget.py);
- decode CUDA graphs are captured for every batch bucket at start-up (`engine/model/cuda_graphs.py`) into one
  private pool the backend keeps, with a cuBLAS workspace per stream that ran a GEMM. Both hold driver memory
  from before the first step (so the controller's start-up profile counts them) and count in the allocator's
  reserved bytes (PyTorch counts private-pool segments and the workspaces it allocates through the caching
  allocator); the KV pool is resized in place, so they never change.

Every constant comes from the profile's [sensors] section, labelled there as fact or hypothesis.
"""

from __future__ import annotations

from engine.backends.twin.allocator import block_round, segment_size
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


class GraphMemory:
    """CUDA graph pools and cuBLAS workspaces: driver memory held beside the weights and the KV pool, outside
    the per-step allocator trace, as the torch backend takes it (engine/model/cuda_graphs.py).

    Every bucket is captured at start-up, largest first, into one private pool the backend keeps: a capture
    reuses what the larger one freed, so the pool holds the largest working set (its cudaMalloc'd segment) plus
    every graph's output. The KV pool is resized in place (engine/core/kv/vmm.py), so the graphs stay valid
    and nothing here changes after start-up. Three streams hold a cuBLAS workspace for the life of the process:
    the compute stream, the one warm-up stream every capture reuses and torch.cuda.graph's capture stream."""

    STREAMS = 3

    def __init__(self, section: dict) -> None:
        buckets = sorted(int(b) for b in section["graph_buckets"])
        outputs = sum(block_round(b * int(section["graph_output_row_bytes"])) for b in buckets)
        pool = segment_size(buckets[-1] * int(section["graph_work_row_bytes"])) if buckets else 0
        workspaces = self.STREAMS * int(section["cublas_workspace_bytes"])
        self.reserved = pool + outputs + workspaces  # bytes held from the driver
        # of those, bytes live in the allocator's stats: a graph's intermediates are free blocks of its pool
        self.allocated = outputs + workspaces

    @classmethod
    def from_profile(cls, profile: Profile) -> GraphMemory:
        return cls(profile.section("sensors"))
