"""The twin's sensors as a bench script's flag (`--twin-sensors`, realistic by default as for `headroom bench`),
so every twin experiment runs with the sensors its registered command names: the committed results taken
before realistic sensors existed keep `--twin-sensors ideal` there (bench/experiments.py)."""

from __future__ import annotations

import argparse

from engine.config import TWIN_SENSORS, EngineConfig


def add_twin_sensors(ap: argparse.ArgumentParser) -> None:
    default = EngineConfig.twin_sensors
    ap.add_argument("--twin-sensors", choices=TWIN_SENSORS, default=default, help="engine/backends/twin/sensors.py")


def twin_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of a twin run with the sensors asked for."""
    return ["--backend", "twin", "--twin-sensors", args.twin_sensors]
