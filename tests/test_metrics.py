"""Prometheus metrics: exact exposed names, values from records, and a promtool check when available."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.controller_stats import ControllerStats
from telemetry.metrics import CONTROLLER_COUNTERS, CONTROLLER_GAUGES, Metrics, RequestTiming, build_1_2_5_buckets
from telemetry.record import MemorySample, StepRecord, StepShape

UNLIMITED = 1 << 30

VLLM_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
}
HEADROOM_NAMES = {
    "headroom_step_peak_bytes",
    "headroom_device_used_bytes",
    "headroom_device_total_bytes",
    "headroom_memory_budget_bytes",
    "headroom_predicted_peak_bytes",
    "headroom_memory_capacity_bytes",
    "headroom_idle_bytes",
    "headroom_limit_max_prefill_tokens",
    "headroom_limit_max_prefill_seqs",
    "headroom_limit_max_decode_seqs",
    "headroom_limit_max_num_seqs",
    "headroom_limit_kv_reserve_ratio",
    "headroom_estimator_margin_bytes",
    "headroom_controller_emergency",
    "headroom_engine_healthy",
    "headroom_backoffs_total",
    "headroom_deferrals_total",
    "headroom_chunked_prefills_total",
    "headroom_ooms_recovered_total",
    "headroom_ooms_total",
    "headroom_rejected_too_long_total",
    "headroom_kv_blocks_used",
    "headroom_kv_blocks_free",
    "headroom_kv_blocks_capacity",
    "headroom_step_duration_seconds_bucket",
}


def record(**kw: object) -> StepRecord:
    limits = {
        "max_prefill_tokens": 2048,
        "max_prefill_seqs": 4,
        "max_decode_seqs": 32,
        "max_num_seqs": 64,
        "max_batched_tokens": UNLIMITED,
        "kv_reserve_ratio": 0.25,
        "allow_mixed": True,
    }
    base: dict = dict(
        step_id=1,
        time=10.0,
        duration=0.03,
        shape=StepShape(prefill_tokens=100, prefill_seqs=1, decode_seqs=7, sampled_seqs=8),
        memory=MemorySample(
            peak_allocated=3 << 30,
            idle_baseline=2 << 30,
            capacity=8 << 30,
            device_used=5 << 30,
            device_total=80 << 30,
            alloc_retries=2,
        ),
        kv_blocks_used=30,
        kv_blocks_free=90,
        kv_blocks_total=120,
        preempted=2,
        prefix_cache_queries=120,
        prefix_cache_hits=96,
        num_running=8,
        num_waiting=3,
        limits=limits,
    )
    base.update(kw)
    return StepRecord(**base)


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted({"model_name": "m", **labels}.items()))))


def exercised() -> Metrics:
    m = Metrics("m", max_model_len=4096)
    m.observe_step(record())
    m.observe_controller(
        ControllerStats(
            budget_bytes=6 << 30,
            predicted_peak_bytes=1 << 30,
            margin_bytes=1 << 28,
            emergency=True,
            backoffs=1,
            deferrals=2,
            chunks=3,
            ooms_recovered=1,
            rejected_too_long=4,
        )
    )
    m.observe_request_finished(100, 3, "stop", RequestTiming(0.0, 2.0, 0.5, 1.0, [1.0, 1.5, 2.0]))
    return m


def test_exposed_names_are_exact() -> None:
    names = {name for name, _ in samples(exercised())}
    assert not VLLM_NAMES - names
    assert not HEADROOM_NAMES - names
    assert not any(n.endswith("_total_total") for n in names)
    assert all(n.startswith(("vllm:", "headroom_")) for n in names)


def test_observe_step_values() -> None:
    m = exercised()
    assert value(m, "vllm:num_requests_running") == 8
    assert value(m, "vllm:num_requests_waiting") == 3
    assert value(m, "vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(m, "vllm:num_preemptions_total") == 2
    assert value(m, "vllm:prompt_tokens_total") == 100
    assert value(m, "vllm:generation_tokens_total") == 8
    assert value(m, "vllm:prefix_cache_queries_total") == 120
    assert value(m, "vllm:prefix_cache_hits_total") == 96
    assert value(m, "headroom_step_peak_bytes") == 1 << 30
    assert value(m, "headroom_idle_bytes") == 2 << 30
    assert value(m, "headroom_memory_capacity_bytes") == 8 << 30
    assert value(m, "headroom_device_used_bytes") == 5 << 30
    assert value(m, "headroom_device_total_bytes") == 80 << 30
    assert value(m, "headroom_alloc_retries_total") == 2
    assert value(m, "headroom_limit_max_num_seqs") == 64
    assert value(m, "headroom_limit_kv_reserve_ratio") == 0.25
    assert value(m, "headroom_limit_max_batched_tokens") is None  # unlimited: no series
    assert value(m, "headroom_kv_blocks_capacity") == 120
    assert value(m, "headroom_step_duration_seconds_count") == 1
    assert value(m, "headroom_step_duration_seconds_sum") == pytest.approx(0.03)


def test_oom_step_counts_oom_not_tokens() -> None:
    m = Metrics("m")
    m.observe_step(record(oom=True))
    assert value(m, "headroom_ooms_total") == 1
    assert value(m, "vllm:prompt_tokens_total") == 0
    assert value(m, "vllm:generation_tokens_total") == 0


def test_unlimited_limits_drop_the_series() -> None:
    m = Metrics("m")
    m.observe_step(record())
    assert value(m, "headroom_limit_max_prefill_tokens") == 2048
    m.observe_step(record(limits={"max_prefill_tokens": UNLIMITED}))
    assert value(m, "headroom_limit_max_prefill_tokens") is None
    m.observe_step(record(limits={"max_prefill_tokens": 512}))
    assert value(m, "headroom_limit_max_prefill_tokens") == 512


def test_device_memory_absent_without_nvml() -> None:
    m = Metrics("m")
    m.observe_step(record(memory=MemorySample(peak_allocated=10, capacity=100)))
    assert value(m, "headroom_device_used_bytes") is None
    assert value(m, "headroom_device_total_bytes") is None


def test_controller_counters_follow_deltas() -> None:
    m = exercised()
    assert value(m, "headroom_memory_budget_bytes") == 6 << 30
    assert value(m, "headroom_controller_emergency") == 1
    assert value(m, "headroom_chunked_prefills_total") == 3
    m.observe_controller(ControllerStats(backoffs=5, chunks=3, ooms_recovered=1, rejected_too_long=4, emergency=False))
    assert value(m, "headroom_backoffs_total") == 5  # +4
    assert value(m, "headroom_chunked_prefills_total") == 3  # unchanged
    assert value(m, "headroom_controller_emergency") == 0
    m.observe_controller(ControllerStats(backoffs=2))  # the controller restarted: count from its new value
    assert value(m, "headroom_backoffs_total") == 7


def test_every_controller_series_reads_a_stats_field_and_an_unset_gauge_keeps_its_value() -> None:
    assert set(CONTROLLER_GAUGES) | set(CONTROLLER_COUNTERS) <= set(ControllerStats.__slots__)
    m = exercised()
    m.observe_controller(ControllerStats(backoffs=1))  # a policy without a budget says None, not 0
    assert value(m, "headroom_memory_budget_bytes") == 6 << 30 and value(m, "headroom_backoffs_total") == 1


def test_request_finished() -> None:
    m = exercised()
    m.observe_request_finished(10, 0, "error", RequestTiming(arrival=5.0, finished=6.0))  # never scheduled
    m.observe_request_finished(10, 1, "length", RequestTiming(0.0, 0.1, 0.01, 0.05, [0.05]))
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(m, "vllm:request_queue_time_seconds_count") == 2
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(1.05)
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert value(m, "vllm:request_prompt_tokens_bucket", le="100.0") == 3
    assert value(m, "vllm:request_generation_tokens_sum") == 4


def test_healthy_and_registry_isolation() -> None:
    a, b = Metrics("a"), Metrics("b")  # two registries: no duplicate-timeseries error
    a.set_healthy(False)
    assert b'headroom_engine_healthy{model_name="a"} 0.0' in a.exposition()
    assert b'headroom_engine_healthy{model_name="b"} 1.0' in b.exposition()


def test_token_buckets_like_vllm() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_check_metrics() -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exercised().exposition(), capture_output=True, timeout=60
    )
    # Exit 1 is a parse error; 3 is lint findings. The only finding allowed is the colon in vLLM's own
    # names (vLLM's /metrics has it too: recording-rule style names are kept for dashboard compatibility).
    findings = [line for line in (result.stdout + result.stderr).decode().splitlines() if line.strip()]
    assert result.returncode in (0, 3), findings
    unexpected = [f for f in findings if not (f.startswith("vllm:") and "should not contain ':'" in f)]
    assert not unexpected, unexpected
