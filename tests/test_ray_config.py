"""The fleet's flags: `headroom serve --replicas N --ray-address ADDR --router R` become ServerConfig fields,
validated once, and pick Ray only when asked for."""

from __future__ import annotations

import argparse

import pytest

from engine.config import ConfigError, ServerConfig
from engine.serving.cli import add_serve_args, configs


def parse(*argv: str) -> ServerConfig:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return configs(p, p.parse_args(list(argv)))[1]


def test_the_flags_set_the_fleet_fields_and_one_replica_stays_one_process() -> None:
    assert not parse().on_ray
    assert not parse("--replicas", "1").on_ray
    scfg = parse("--replicas", "4", "--router", "default")
    assert (scfg.replicas, scfg.router, scfg.ray_address, scfg.on_ray) == (4, "default", None, True)
    joined = parse("--ray-address", "10.0.0.1:6379")
    assert joined.on_ray and joined.replicas == 1 and joined.router == "headroom"
    assert ServerConfig.from_json(scfg.to_json()) == scfg


def test_bad_fleet_values_name_their_field() -> None:
    with pytest.raises(ConfigError, match="replicas"):
        ServerConfig(replicas=0)
    with pytest.raises(ConfigError, match="router"):
        ServerConfig(router="round-robin")
    with pytest.raises(SystemExit):
        parse("--router", "round-robin")


def test_a_replica_asks_ray_for_one_gpu_a_tensor_parallel_rank() -> None:
    from engine.config import EngineConfig
    from engine.serving.ray_serve.launcher import replica_resources

    assert replica_resources(EngineConfig(device="cuda", tensor_parallel_size=2))["num_gpus"] == 2
    assert replica_resources(EngineConfig(device="cuda"))["num_gpus"] == 1
    assert "num_gpus" not in replica_resources(EngineConfig(device="cpu", tensor_parallel_size=2))
    assert "num_gpus" not in replica_resources(EngineConfig(backend="twin", tensor_parallel_size=2))
