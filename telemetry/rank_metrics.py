"""Per-rank gauges for a tensor-parallel engine, each labelled with its `rank`: what every rank's own probe
measured in the last step and the KV pool it holds. The unlabelled memory gauges (telemetry/metrics.py) show
the tightest-rank combination the controller acts on; these show where it came from."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from telemetry.record import RankSample

RANK_GAUGES = {
    "step_peak": ("headroom_rank_step_peak_bytes", "Last step's peak above idle on this rank."),
    "peak_allocated": ("headroom_rank_peak_allocated_bytes", "Last step's allocator peak on this rank, idle included."),
    "idle": ("headroom_rank_idle_bytes", "Allocated bytes with no step running on this rank."),
    "capacity": ("headroom_rank_memory_capacity_bytes", "Bytes the allocator may use on this rank's device."),
    "device_used": ("headroom_rank_device_used_bytes", "Device used bytes on this rank's device (NVML)."),
    "kv_blocks": ("headroom_rank_kv_blocks", "KV blocks this rank holds (its shard of every block)."),
    "kv_bytes": ("headroom_rank_kv_bytes", "Bytes of this rank's KV shard."),
}


def rank_values(sample: RankSample) -> dict[str, int | None]:
    """The figures the gauges show, by RANK_GAUGES key (None: the device cannot tell)."""
    m = sample.memory
    return {
        "step_peak": m.step_peak,
        "peak_allocated": m.peak_allocated,
        "idle": m.idle_baseline,
        "capacity": m.capacity,
        "device_used": m.device_used,
        "kv_blocks": sample.kv_blocks,
        "kv_bytes": sample.kv_bytes,
    }


class RankMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self._gauges = {
            key: Gauge(metric, doc, ["model_name", "rank"], registry=registry)
            for key, (metric, doc) in RANK_GAUGES.items()
        }

    def observe(self, ranks: list[RankSample]) -> None:
        for sample in ranks:
            for key, value in rank_values(sample).items():
                if value is not None:
                    self._gauges[key].labels(self.model_name, str(sample.rank)).set(value)
