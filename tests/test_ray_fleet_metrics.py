"""The fleet's /metrics: every replica's exposition merged into one, each series labelled with its replica."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.serving.ray_serve.fleet_metrics import merge_expositions
from telemetry.metrics import Metrics


def replica_text(kv_free: int, successes: int) -> str:
    m = Metrics("model", 1024)
    m.kv_free.set(kv_free)
    m.success["stop"].inc(successes)
    return m.exposition().decode()


def test_every_replica_series_gets_its_replica_label_once_per_family() -> None:
    text = merge_expositions({"r1": replica_text(10, 3), "r2": replica_text(20, 5)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    free = {s.labels["replica"]: s.value for s in families["headroom_kv_blocks_free"].samples}
    assert free == {"r1": 10, "r2": 20}
    stops = {s.labels["replica"]: s.value for s in families["vllm:request_success"].samples
             if s.labels["finished_reason"] == "stop" and s.name.endswith("_total")}  # fmt: skip
    assert stops == {"r1": 3, "r2": 5}
    assert text.count("# TYPE headroom_kv_blocks_free gauge") == 1
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in ttft) == ["r1", "r2"]


def test_no_replica_gives_an_empty_exposition() -> None:
    assert merge_expositions({}) == b""
