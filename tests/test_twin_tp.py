"""The twin at --tensor-parallel-size 2: per-rank memory as the torch backend shards the model, per-rank step
time from the kernel tables at the sharded shapes plus the all-reduce hypothesis, and the controller sizing
the pool by the tightest rank (all twin numbers)."""

from __future__ import annotations

import pytest

from bench.cli import run_point
from bench.loadgen import run_closed_loop
from engine.backends.twin.latency import LatencyModel, StepWork
from engine.backends.twin.profile import load_profile
from engine.backends.twin.tensor_parallel import TwinGroup, rank_profile
from engine.config import ConfigError, EngineConfig
from engine.factory import build_engine
from telemetry.units import GIB


def test_rank_profiles_shard_the_weights_and_kv_and_keep_the_lm_head_on_rank_0() -> None:
    base = load_profile()
    model, tp = base.section("model"), base.section("tensor_parallel")
    table = model["vocab"] * model["hidden"] * 2
    r0, r1 = (rank_profile(base, r, 2) for r in (0, 1))
    assert r1.section("model")["weight_bytes"] == (model["weight_bytes"] - 2 * table) // 2 + table
    assert r0.section("model")["weight_bytes"] == r1.section("model")["weight_bytes"] + table
    assert r0.section("model")["kv_bytes_per_token"] == model["kv_bytes_per_token"] // 2
    assert r0.section("device")["cuda_context_bytes"] == base.section("device")["cuda_context_bytes"] + tp["nccl_bytes"]
    assert "size" not in base.section("tensor_parallel")  # the one-card profile is untouched


def test_a_rank_runs_half_the_kernels_plus_the_all_reduces() -> None:
    base = load_profile()
    one, rank = LatencyModel(base), LatencyModel(rank_profile(base, 1, 2))
    tp = base.section("tensor_parallel")
    row = base.section("model")["hidden"] * 2 / tp["allreduce_bus_bytes_per_s"]
    assert one.allreduce(4096) == 0.0
    assert rank.allreduce(4096) == pytest.approx(64 * (tp["allreduce_latency_s"] + 4096 * row))
    decode = StepWork(decode_seqs=8, decode_context=8 * 1000)  # no logits rows: rank 1's work
    assert rank.kernel_time(decode) - rank.allreduce(8) < 0.55 * one.kernel_time(decode)
    assert rank.kernel_time(decode) - rank.allreduce(8) > 0.45 * one.kernel_time(decode)


def test_twin_tp_runs_a_point_with_every_ranks_record_and_the_pool_the_controller_sized() -> None:
    cfg = EngineConfig(backend="twin", policy="adaptive", tensor_parallel_size=2)
    engine = build_engine(cfg)
    records = []
    engine.step_listeners.append(lambda record, _batch: records.append(record))
    group = engine.backend
    assert isinstance(group, TwinGroup)
    per_block = group.ranks[0].block_bytes
    assert per_block == 256 * load_profile().section("model")["kv_bytes_per_token"] // 2
    point = run_point(cfg, (4, 256, 256))
    assert (point["failed"], point["ooms"]) == (0, 0)
    assert point["kv_pool_peak_blocks"] > 64 * 4  # half a block a rank, and the weights halved: far more blocks
    run_closed_loop(engine, 2, 4, 256, 32)
    ranks = records[-1].ranks
    assert [r.rank for r in ranks] == [0, 1]
    assert ranks[0].memory.idle_baseline > ranks[1].memory.idle_baseline  # the LM head and its logits
    assert engine.policy.state()["ranks"][0]["binding"]


def test_another_process_on_rank_1s_card_makes_rank_1_bind_and_the_pool_shrink() -> None:
    engine = build_engine(EngineConfig(backend="twin", policy="adaptive", tensor_parallel_size=2, twin_sensors="ideal"))
    run_closed_loop(engine, 2, 4, 256, 32)
    before = engine.allocator.num_blocks
    engine.backend.ranks[1].set_external(4 * GIB)
    run_closed_loop(engine, 2, 4, 256, 32)
    assert engine.allocator.num_blocks < before
    assert [r["binding"] for r in engine.policy.state()["ranks"]] == [False, True]


def test_the_twin_models_two_cards_only() -> None:
    with pytest.raises(ConfigError, match="two"):
        EngineConfig(backend="twin", tensor_parallel_size=4)
