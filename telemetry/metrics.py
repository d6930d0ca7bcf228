"""Prometheus metrics: vLLM's names where the meaning is the same (so existing vLLM dashboards work),
`headroom_*` for the controller and memory. Own CollectorRegistry (tests and several engines in one
process must not collide). Units: bytes and seconds.

Unlimited limits (>= controller.limits.UNLIMITED, 1 << 30) are not exported: the series is removed,
so a Grafana panel shows a gap ("no limit") instead of a 1e9 spike that flattens the y-axis, and
PromQL comparisons skip it. The limit gauges exist only while a finite limit is in force.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from telemetry.controller_stats import ControllerStats
from telemetry.rank_metrics import RankMetrics
from telemetry.record import StepRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the Content-Type header for exposition()
UNLIMITED = 1 << 30  # same value as controller.limits.UNLIMITED (telemetry may not import controller)
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's bucket choices (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
STEP_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# StepRecord.limits keys (controller.limits.Limits fields) exported as headroom_limit_<key>.
LIMIT_KEYS = (
    "max_prefill_tokens",
    "max_prefill_seqs",
    "max_decode_seqs",
    "max_num_seqs",
    "max_batched_tokens",
    "kv_reserve_ratio",
)
# observe_controller: ControllerStats count field -> counter name.
CONTROLLER_COUNTERS = {
    "backoffs": "headroom_backoffs",
    "deferrals": "headroom_deferrals",
    "chunks": "headroom_chunked_prefills",
    "ooms_recovered": "headroom_ooms_recovered",
    "rejected_too_long": "headroom_rejected_too_long",
    "kv_pool_resizes": "headroom_kv_pool_resizes",
}
# observe_controller: ControllerStats gauge field -> gauge name.
CONTROLLER_GAUGES = {
    "budget_bytes": "headroom_memory_budget_bytes",
    "predicted_peak_bytes": "headroom_predicted_peak_bytes",
    "margin_bytes": "headroom_estimator_margin_bytes",
    "emergency": "headroom_controller_emergency",
    "kv_pool_bytes": "headroom_kv_pool_bytes",
    "effective_prefill_tokens": "headroom_effective_prefill_tokens",
}


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


@dataclass
class RequestTiming:
    """When things happened to one request (seconds on the backend clock: wall or virtual)."""

    arrival: float
    finished: float
    first_scheduled: float | None = None  # None: never scheduled (aborted/rejected while waiting)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # time of every output token, first included


class _Family:
    """Metric constructors on one registry, labelled by model name (and any extra labels)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def gauge(self, metric: str, doc: str) -> Gauge:
        return Gauge(metric, doc, ["model_name"], registry=self.registry)

    def counter(self, metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(metric, doc, ["model_name", *extra], registry=self.registry)  # exposed as <metric>_total

    def histogram(self, metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(metric, doc, ["model_name"], buckets=buckets, registry=self.registry)


class Metrics:
    def __init__(self, model_name: str = "default", max_model_len: int = 8192) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        family = _Family(self.registry)
        self._init_vllm(family, build_1_2_5_buckets(max_model_len))
        self._init_memory(family)
        self._init_controller(family)
        self._init_engine(family)
        self.ranks = RankMetrics(self.registry, model_name)

    def _init_vllm(self, f: _Family, token_buckets: tuple[float, ...]) -> None:
        """vLLM's names and meanings, so existing vLLM dashboards work."""
        name = self.model_name
        self.running = f.gauge("vllm:num_requests_running", "Requests in the running batch.").labels(name)
        self.waiting = f.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.").labels(name)
        self.kv_usage = f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.").labels(name)
        self.preemptions = f.counter("vllm:num_preemptions", "Cumulative preemptions.").labels(name)
        self.prompt_tokens = f.counter(
            "vllm:prompt_tokens", "Prefill tokens processed (recomputed after preemption counted again)."
        ).labels(name)
        self.generation_tokens = f.counter("vllm:generation_tokens", "Generation tokens produced.").labels(name)
        self.prefix_cache_queries = f.counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens (every token of each admitted request)."
        ).labels(name)
        self.prefix_cache_hits = f.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens (KV taken from the cache at admission)."
        ).labels(name)
        success = f.counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        self.success = {reason: success.labels(name, reason) for reason in FINISH_REASONS}
        self.ttft = f.histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS).labels(name)
        self.itl = f.histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS).labels(name)
        self.e2e = f.histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS
        ).labels(name)
        self.queue_time = f.histogram(
            "vllm:request_queue_time_seconds", "Time from arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        ).labels(name)
        self.request_prompt_tokens = f.histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        ).labels(name)
        self.request_generation_tokens = f.histogram(
            "vllm:request_generation_tokens", "Generated tokens of finished requests.", token_buckets
        ).labels(name)

    def _init_memory(self, f: _Family) -> None:
        name = self.model_name
        self.step_peak = f.gauge("headroom_step_peak_bytes", "Last step's peak above idle.").labels(name)
        self._device_used = f.gauge("headroom_device_used_bytes", "Device used bytes (NVML), all processes.")
        self._device_total = f.gauge("headroom_device_total_bytes", "Device total bytes (NVML).")
        self.capacity = f.gauge("headroom_memory_capacity_bytes", "Bytes the allocator may use.").labels(name)
        self.idle = f.gauge("headroom_idle_bytes", "Allocated bytes with no step running.").labels(name)
        self.alloc_retries = f.counter(
            "headroom_alloc_retries", "Allocator retries (cache flushed and retried)."
        ).labels(name)
        self._alloc_retries_last = 0

    def _init_controller(self, f: _Family) -> None:
        name = self.model_name
        self._limit_gauges = {
            key: f.gauge(f"headroom_limit_{key}", f"Limit in force: {key} (absent when unlimited).")
            for key in LIMIT_KEYS
        }
        self._limit_set: set[str] = set()
        self.controller_gauges = {
            key: f.gauge(metric, f"Controller state: {key}.").labels(name) for key, metric in CONTROLLER_GAUGES.items()
        }
        self.controller_counters = {
            key: f.counter(metric, f"Controller events: {key}.").labels(name)
            for key, metric in CONTROLLER_COUNTERS.items()
        }
        self._controller_last: dict[str, int] = {}

    def _init_engine(self, f: _Family) -> None:
        name = self.model_name
        self.step_phase = f.counter(
            "headroom_step_phase_seconds", "Engine step wall time by phase (telemetry/phases.py).", ("phase",)
        )
        self._phase_last: dict[str, float] = {}
        self.healthy = f.gauge("headroom_engine_healthy", "1 while the engine serves.").labels(name)
        self.healthy.set(1)
        self.ooms = f.counter("headroom_ooms", "Steps that raised OutOfMemoryError.").labels(name)
        self.kv_used = f.gauge("headroom_kv_blocks_used", "KV blocks in use.").labels(name)
        self.kv_free = f.gauge("headroom_kv_blocks_free", "KV blocks free.").labels(name)
        # Not headroom_kv_blocks_total: promtool rejects a _total suffix on anything but a counter.
        self.kv_total = f.gauge("headroom_kv_blocks_capacity", "KV blocks in the pool.").labels(name)
        self.step_duration = f.histogram(
            "headroom_step_duration_seconds", "Engine step duration.", STEP_DURATION_BUCKETS
        ).labels(name)

    def observe_step(self, record: StepRecord) -> None:
        """Everything one StepRecord says. Called once per step by the engine thread (tens of us)."""
        name, mem, shape = self.model_name, record.memory, record.shape
        self.running.set(record.num_running)
        self.waiting.set(record.num_waiting)
        total = record.kv_blocks_total
        self.kv_usage.set(record.kv_blocks_used / total if total else 0.0)
        self.kv_used.set(record.kv_blocks_used)
        self.kv_free.set(record.kv_blocks_free)
        self.kv_total.set(total)
        if record.preempted:
            self.preemptions.inc(record.preempted)
        if record.oom:
            self.ooms.inc()
        else:  # an OOM step computed nothing
            if shape.prefill_tokens:
                self.prompt_tokens.inc(shape.prefill_tokens)
            if shape.sampled_seqs:
                self.generation_tokens.inc(shape.sampled_seqs)
        if record.prefix_cache_queries:  # admissions stand even when the step then OOMs
            self.prefix_cache_queries.inc(record.prefix_cache_queries)
            self.prefix_cache_hits.inc(record.prefix_cache_hits)
        self.step_duration.observe(record.duration)
        self.step_peak.set(mem.step_peak)
        self.capacity.set(mem.capacity)
        self.idle.set(mem.idle_baseline)
        if mem.device_used is not None:
            self._device_used.labels(name).set(mem.device_used)
        if mem.device_total is not None:
            self._device_total.labels(name).set(mem.device_total)
        if mem.alloc_retries > self._alloc_retries_last:
            self.alloc_retries.inc(mem.alloc_retries - self._alloc_retries_last)
        self._alloc_retries_last = mem.alloc_retries
        finite = {k: v for k, v in record.limits.items() if k in self._limit_gauges and v < UNLIMITED}
        for key in self._limit_set - finite.keys():
            self._limit_gauges[key].remove(name)
        for key, value in finite.items():
            self._limit_gauges[key].labels(name).set(value)
        self._limit_set = set(finite)
        if record.ranks:
            self.ranks.observe(record.ranks)

    def observe_controller(self, stats: ControllerStats) -> None:
        """The policy's stats: gauges as given (None: not set), counters by the delta of the cumulative
        counts (a count that went down means the controller restarted: its new value is the delta)."""
        for key, child in self.controller_gauges.items():
            value = getattr(stats, key)
            if value is not None:
                child.set(float(value))
        for key, child in self.controller_counters.items():
            value = getattr(stats, key)
            last = self._controller_last.get(key, 0)
            delta = value - last if value >= last else value
            if delta > 0:
                child.inc(delta)
            self._controller_last[key] = value

    def observe_phases(self, totals: dict[str, float]) -> None:
        """PhaseTimer.totals(): cumulative seconds per phase, exported by their deltas."""
        for phase, seconds in totals.items():
            delta = seconds - self._phase_last.get(phase, 0.0)
            if delta > 0:
                self.step_phase.labels(self.model_name, phase).inc(delta)
            self._phase_last[phase] = seconds

    def observe_request_finished(
        self, prompt_tokens: int, generation_tokens: int, finish_reason: str, timing: RequestTiming
    ) -> None:
        """Request-level histograms, observed once when a request ends. `finish_reason` outside
        stop|length is counted as abort (errors and OOM-failed requests, from the client's view)."""
        reason = finish_reason if finish_reason in FINISH_REASONS else "abort"
        self.success[reason].inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.e2e.observe(max(0.0, timing.finished - timing.arrival))
        if timing.first_scheduled is not None:
            self.queue_time.observe(max(0.0, timing.first_scheduled - timing.arrival))
        if timing.first_token is not None:
            self.ttft.observe(max(0.0, timing.first_token - timing.arrival))
        times = timing.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.itl.observe(max(0.0, later - earlier))

    def set_healthy(self, healthy: bool) -> None:
        self.healthy.set(1 if healthy else 0)

    def exposition(self) -> bytes:
        """The text exposition format, for GET /metrics (serve with CONTENT_TYPE)."""
        return generate_latest(self.registry)
