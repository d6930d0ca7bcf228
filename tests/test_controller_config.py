"""Controller config: defaults, TOML, environment overrides, validation, runtime patches."""

from __future__ import annotations

import dataclasses
import re
import tomllib

import pytest

from controller.adaptive import AdaptivePolicy
from controller.config import DEFAULT_TOML, ControllerConfig, gain_fields, load_config


def test_defaults_are_valid() -> None:
    cfg = ControllerConfig()
    assert cfg.replace({}) == cfg
    assert load_config(None, env={}) == cfg


def test_default_toml_documents_every_gain_with_its_default_and_unit() -> None:
    text = DEFAULT_TOML.read_text()
    table = tomllib.loads(text)["controller"]
    names = [f.name for f in gain_fields()]
    assert sorted(table) == sorted(names)
    defaults = ControllerConfig()
    for name in names:
        assert table[name] == getattr(defaults, name), name
    # every gain line is preceded by a comment block that names its unit
    lines = text.splitlines()
    for name in names:
        i = next(k for k, line in enumerate(lines) if re.match(rf"{name}\s*=", line))
        block = []
        k = i - 1
        while k >= 0 and lines[k].startswith("#"):
            block.append(lines[k])
            k -= 1
        assert any("unit:" in line for line in block), f"{name} has no documented unit"
    assert load_config(DEFAULT_TOML, env={}) == defaults


def test_toml_file_with_controller_table(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[controller]\nheadroom_frac = 0.05\nmargin_window = 64\nuse_device_used = false\n")
    cfg = load_config(p, env={})
    assert cfg.headroom_frac == 0.05 and cfg.margin_window == 64 and cfg.use_device_used is False


def test_toml_top_level_and_int_for_float(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("backoff = 0.7\nheadroom_min_mib = 512\n")
    cfg = load_config(p, env={})
    assert cfg.backoff == 0.7 and cfg.headroom_min_mib == 512.0


def test_env_overrides_file(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[controller]\nbackoff = 0.7\n")
    env = {
        "HEADROOM_CONTROLLER_BACKOFF": "0.6",
        "HEADROOM_CONTROLLER_MIN_CHUNK": "64",
        "HEADROOM_CONTROLLER_USE_DEVICE_USED": "off",
        "OTHER": "x",
    }
    cfg = load_config(p, env=env)
    assert cfg.backoff == 0.6 and cfg.min_chunk == 64 and cfg.use_device_used is False


@pytest.mark.parametrize(
    "patch, word",
    [
        ({"backoff": 1.5}, "backoff"),
        ({"backoff": "fast"}, "backoff"),
        ({"margin_window": 3.5}, "margin_window"),
        ({"margin_window": True}, "margin_window"),
        ({"forgetting": float("nan")}, "forgetting"),
        ({"no_such_gain": 1}, "no_such_gain"),
        ({"recover_below": 1.2, "backoff_threshold": 1.1}, "hysteresis"),
        ({"kv_ratio_floor": 0.9}, "kv_ratio_floor"),
        ({"min_chunk": 1024}, "min_chunk"),
    ],
)
def test_bad_values_rejected_with_a_clear_message(patch: dict, word: str) -> None:
    cfg = ControllerConfig()
    with pytest.raises(ValueError, match=word):
        cfg.replace(patch)


def test_bad_env_value_names_source_and_gain() -> None:
    with pytest.raises(ValueError, match=r"environment: headroom_frac"):
        load_config(None, env={"HEADROOM_CONTROLLER_HEADROOM_FRAC": "-1"})


def test_bad_file_value_names_file(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[controller]\nforgetting = 2\n")
    with pytest.raises(ValueError, match="bad.toml: forgetting"):
        load_config(p, env={})


def test_update_config_is_atomic() -> None:
    pol = AdaptivePolicy()
    before = pol.cfg
    with pytest.raises(ValueError):
        pol.update_config({"backoff": 0.5, "oom_backoff": 7})  # second entry is bad: nothing changes
    assert pol.cfg is before and pol.law.cfg is before
    pol.update_config({"backoff": 0.5, "margin_quantile": 0.9, "headroom_frac": 0.1})
    assert pol.cfg.backoff == 0.5 and pol.law.cfg.backoff == 0.5
    assert all(w.q == 0.9 for w in pol.memory.estimator.windows.values())
    assert pol.memory.budget.headroom_frac == 0.1
    assert pol.state()["config"]["backoff"] == 0.5
    assert pol.state()["decisions"][-1]["action"] == "config"


def test_every_gain_has_bounds_and_unit() -> None:
    for f in dataclasses.fields(ControllerConfig):
        assert {"unit", "min", "max", "doc"} <= set(f.metadata), f.name
        assert f.metadata["min"] <= f.default <= f.metadata["max"], f.name


def test_plant_defaults_come_before_the_file_and_the_environment(tmp_path) -> None:
    plant = {"max_prefill_tokens": 2048}
    assert load_config(None, env={}, plant_defaults=plant).max_prefill_tokens == 2048
    p = tmp_path / "c.toml"
    p.write_text("[controller]\nmax_prefill_tokens = 8192\n")
    assert load_config(p, env={}, plant_defaults=plant).max_prefill_tokens == 8192
    env = {"HEADROOM_CONTROLLER_MAX_PREFILL_TOKENS": "4096"}
    assert load_config(None, env=env, plant_defaults=plant).max_prefill_tokens == 4096


def test_the_engine_sets_cpu_plant_defaults_and_caps_prefill_only_where_memory_does_not_bind() -> None:
    from engine.config import EngineConfig
    from engine.factory import CPU_CONTROLLER_DEFAULTS, CPU_UNBOUNDED_DEFAULTS, build_policy

    floor = CPU_CONTROLLER_DEFAULTS["margin_floor_mib"]
    cap = CPU_UNBOUNDED_DEFAULTS["max_prefill_tokens"]
    cpu = build_policy(EngineConfig(policy="adaptive", device="cpu")).cfg
    assert cpu.max_prefill_tokens == cap < ControllerConfig().max_prefill_tokens
    assert cpu.margin_floor_mib == floor < ControllerConfig().margin_floor_mib
    bounded = build_policy(EngineConfig(policy="adaptive", device="cpu", device_memory="2GiB")).cfg
    assert (bounded.margin_floor_mib, bounded.max_prefill_tokens) == (floor, ControllerConfig().max_prefill_tokens)
    twin = build_policy(EngineConfig(policy="adaptive", backend="twin")).cfg
    assert twin == ControllerConfig()  # the CUDA allocator's rounding is modelled there: the controller's own
