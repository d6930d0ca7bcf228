"""Gains of the adaptive controller: one frozen dataclass, loaded from TOML, overridden by environment
variables, validated with bounds.

Why one flat dataclass: every gain is a single documented number with a unit and bounds, the same object
is shown by GET /controller/state and patched at run time by `update_config`, and a frozen value can be
swapped atomically (build a new one, validate it, then replace the reference) so a bad patch changes
nothing. controller/default.toml documents every field; a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "HEADROOM_CONTROLLER_"
DEFAULT_TOML = Path(__file__).with_name("default.toml")


def _gain(default: float | int, unit: str, lo: float, hi: float, doc: str) -> Any:
    return field(default=default, metadata={"unit": unit, "min": lo, "max": hi, "doc": doc})


@dataclass(frozen=True)
class ControllerConfig:
    """Every gain of the controller. Units: MiB for memory, steps for time, tokens/sequences for caps."""

    # --- budget: usable = capacity - idle - headroom, headroom = max(frac * capacity, min) ---------
    headroom_frac: float = _gain(0.03, "fraction of capacity", 0.0, 0.5, "setpoint headroom share")
    headroom_min_mib: float = _gain(128.0, "MiB", 0.0, 65536.0, "setpoint headroom floor")
    use_device_used: bool = _gain(True, "bool", 0, 1, "tighten capacity by memory outside the allocator")
    # --- estimator ----------------------------------------------------------------------------------
    forgetting: float = _gain(0.995, "per sampled step", 0.9, 1.0, "RLS forgetting factor")
    prior_variance: float = _gain(100.0, "MiB^2 per unit^2", 1e-3, 1e9, "RLS covariance at (re)start")
    margin_quantile: float = _gain(0.95, "quantile", 0.5, 1.0, "upper quantile of relative residuals")
    margin_window: int = _gain(64, "sampled steps", 8, 4096, "residuals kept per regime")
    margin_floor_mib: float = _gain(16.0, "MiB", 0.0, 4096.0, "margin added to every prediction")
    margin_cold: float = _gain(0.5, "fraction of prediction", 0.0, 10.0, "relative margin before data")
    change_threshold: float = _gain(0.5, "relative residual", 0.05, 100.0, "residual that signals change")
    change_count: int = _gain(2, "sampled steps", 1, 1000, "consecutive large residuals -> reset")
    # --- control law --------------------------------------------------------------------------------
    backoff: float = _gain(0.8, "factor", 0.1, 0.99, "budget scale x this on a near miss")
    oom_backoff: float = _gain(0.5, "factor", 0.05, 0.99, "budget scale and caps x this on an OOM")
    retry_backoff: float = _gain(1.0, "factor", 0.1, 1.0, "budget scale x this on an allocator retry")
    backoff_threshold: float = _gain(1.0, "fraction of usable", 0.5, 2.0, "measured peak above -> backoff")
    recover_below: float = _gain(0.95, "fraction of usable", 0.1, 2.0, "measured peak below -> may recover")
    recovery_step: float = _gain(0.02, "fraction of usable per step", 1e-4, 0.5, "additive recovery")
    recovery_hold: int = _gain(8, "steps", 0, 100000, "clean steps after a backoff before recovery")
    backoff_cooldown: int = _gain(4, "steps", 0, 100000, "at most one near-miss backoff per this")
    min_scale: float = _gain(0.1, "fraction of usable", 0.01, 1.0, "anti-windup floor of the scale")
    emergency_steps: int = _gain(16, "steps", 0, 100000, "emergency flag held after an OOM")
    # --- caps (trust region for the estimator; slow start, then additive increase) --------------------
    cold_prefill_tokens: int = _gain(256, "tokens", 1, 1 << 20, "prefill budget before any data")
    cold_decode_seqs: int = _gain(32, "sequences", 1, 1 << 16, "decode batch before any data")
    slow_start_growth: float = _gain(2.0, "factor per step", 1.0, 16.0, "cap growth over a proven size")
    cap_recovery_tokens: int = _gain(128, "tokens per step", 1, 1 << 20, "prefill cap regrowth")
    cap_recovery_seqs: int = _gain(2, "sequences per step", 1, 1 << 16, "decode cap regrowth")
    max_prefill_tokens: int = _gain(16384, "tokens", 1, 1 << 24, "ceiling of the prefill budget")
    max_prefill_seqs: int = _gain(64, "sequences", 1, 1 << 16, "prompts (chunks) in one step")
    max_decode_seqs: int = _gain(256, "sequences", 1, 1 << 16, "ceiling of the decode batch")
    max_num_seqs: int = _gain(256, "sequences", 1, 1 << 16, "admitted (running) sequences")
    min_chunk: int = _gain(32, "tokens", 1, 1 << 20, "smallest prefill chunk worth a step")
    # --- KV reservation (SGLang new_token_ratio rule as the baseline) ---------------------------------
    kv_ratio_init: float = _gain(0.0, "fraction of max_tokens", 0.0, 1.0, "reservation ratio at start")
    kv_ratio_floor: float = _gain(0.0, "fraction of max_tokens", 0.0, 1.0, "lowest reservation ratio")
    kv_ratio_decay_steps: int = _gain(600, "decode steps", 1, 1 << 24, "time to decay by 1.0")
    kv_ratio_jump: float = _gain(0.0, "fraction of max_tokens", 0.0, 1.0, "ratio rise on preemption")
    kv_churn_max: float = _gain(50.0, "preemptions per 1000 steps", 0.0, 1e6, "tolerated churn")
    kv_floor_step: float = _gain(0.05, "fraction of max_tokens", 0.0, 1.0, "floor rise when churn is over")
    kv_preempt_swap: bool = _gain(True, "bool", 0, 1, "preempt by swap to host where the backend can")

    # --- KV pool sizing (controller/pool_rules.py; only without --num-blocks) ---------------------------
    pool_reserve_tokens: int = _gain(1024, "tokens", 1, 1 << 20, "profiled prefill step the pool leaves room for")
    pool_min_reserve_tokens: int = _gain(256, "tokens", 1, 1 << 20, "prefill the pool leaves room for while KV binds")
    pool_hysteresis_mib: float = _gain(256.0, "MiB", 0.0, 65536.0, "room beyond one block before the pool grows")
    pool_grow_hold: int = _gain(32, "decisions", 1, 100000, "consecutive decisions with room before a grow")
    pool_cooldown: int = _gain(16, "steps", 0, 100000, "at most one resize per this, tight-memory shrinks excepted")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, patch: Mapping[str, Any]) -> ControllerConfig:
        """A validated copy with `patch` applied; ValueError (and nothing changed) on any bad entry."""
        return _build(self, patch, source="patch")


def gain_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(ControllerConfig)


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Parse a value (TOML scalar or env string) into the field's type, then check bounds."""
    name, kind = f.name, f.type
    try:
        if kind == "bool":
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                value = low in ("1", "true", "yes", "on")
            elif not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(value, bool):
            raise ValueError
        if kind == "int":
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                value = int(value)
            value = int(value)
        else:
            value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name} must be a {kind}, got {value!r}") from None
    lo, hi = f.metadata["min"], f.metadata["max"]
    if not (lo <= value <= hi):  # also rejects NaN
        raise ValueError(f"{source}: {name}={value!r} is out of bounds [{lo}, {hi}] ({f.metadata['unit']})")
    return value


def _check_cross(cfg: ControllerConfig, source: str) -> None:
    if cfg.recover_below > cfg.backoff_threshold:
        raise ValueError(
            f"{source}: recover_below ({cfg.recover_below}) must not exceed backoff_threshold "
            f"({cfg.backoff_threshold}): the gap between them is the hysteresis band"
        )
    if cfg.kv_ratio_floor > cfg.kv_ratio_init:
        raise ValueError(f"{source}: kv_ratio_floor ({cfg.kv_ratio_floor}) exceeds kv_ratio_init")
    if not cfg.min_chunk <= cfg.cold_prefill_tokens <= cfg.max_prefill_tokens:
        raise ValueError(f"{source}: need min_chunk <= cold_prefill_tokens <= max_prefill_tokens")
    if cfg.pool_min_reserve_tokens > cfg.pool_reserve_tokens:
        raise ValueError(f"{source}: pool_min_reserve_tokens exceeds pool_reserve_tokens")
    if cfg.cold_decode_seqs > cfg.max_decode_seqs:
        raise ValueError(f"{source}: cold_decode_seqs exceeds max_decode_seqs")


def _build(base: ControllerConfig, patch: Mapping[str, Any], source: str) -> ControllerConfig:
    by_name = {f.name: f for f in gain_fields()}
    unknown = sorted(set(patch) - set(by_name))
    if unknown:
        raise ValueError(f"{source}: unknown gain(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    values = {k: _coerce(by_name[k], v, source) for k, v in patch.items()}
    cfg = dataclasses.replace(base, **values)
    _check_cross(cfg, source)
    return cfg


def load_config(
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    plant_defaults: Mapping[str, Any] | None = None,
) -> ControllerConfig:
    """Defaults, then the plant's own defaults (the engine's, for a kind of device), then the TOML file (top
    level or its [controller] table), then HEADROOM_CONTROLLER_<GAIN> environment variables. Raises
    ValueError naming the source and the gain on any bad value."""
    cfg = _build(ControllerConfig(), plant_defaults, "the plant's defaults") if plant_defaults else ControllerConfig()
    if path is not None:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        table = data.get("controller", data)
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [controller] must be a table")
        cfg = _build(cfg, table, source=str(path))
    env = os.environ if env is None else env
    overrides = {
        k[len(ENV_PREFIX) :].lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX) and len(k) > len(ENV_PREFIX)
    }
    if overrides:
        cfg = _build(cfg, overrides, source="environment")
    return cfg
