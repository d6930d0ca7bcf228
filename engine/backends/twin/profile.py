"""A twin profile: one GPU + model pair as data (TOML facts and fitted constants, plus the measured kernel
tables beside it). Nothing about a particular card lives in code, so a second profile is a data change and
the twin's fitted hypotheses can be read, diffed and cited (docs/twin.md) without reading Python."""

from __future__ import annotations

import csv
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "rtx4090-llama3.1-8b"


@dataclass(frozen=True)
class KernelTables:
    """Per-layer kernel times in microseconds, exactly as measured (no smoothing)."""

    dense: dict[str, dict[int, float]]  # op -> tokens -> us (one decoder layer, or the model-level ops)
    per_sequence: dict[str, dict[int, float]]  # lm_head / sampler -> rows -> us
    attention: dict[tuple[int, int, int, int], float]  # (prefill_chunk, kv_prefill, n_decode, kv_decode) -> us


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    data: dict[str, Any]  # the parsed TOML; sections documented in the file itself
    kernels: KernelTables

    def section(self, key: str) -> dict[str, Any]:
        return self.data[key]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def load_kernels(directory: Path) -> KernelTables:
    dense: dict[str, dict[int, float]] = defaultdict(dict)
    for r in _read_csv(directory / "dense.csv"):
        dense[r["layer"]][int(r["tokens"])] = float(r["time_us"])
    per_seq: dict[str, dict[int, float]] = defaultdict(dict)
    for r in _read_csv(directory / "per_sequence.csv"):
        per_seq[r["layer"]][int(r["sequences"])] = float(r["time_us"])
    attn = {
        (int(r["prefill_chunk"]), int(r["kv_prefill"]), int(r["n_decode"]), int(r["kv_decode"])): float(r["time_us"])
        for r in _read_csv(directory / "attention.csv")
    }
    return KernelTables(dict(dense), dict(per_seq), attn)


@cache
def load_profile(name: str = DEFAULT_PROFILE, directory: Path = PROFILE_DIR) -> Profile:
    """Load `<directory>/<name>.toml` and the kernel tables its `[kernels] dir` names (cached: a profile
    is immutable data, and a matrix builds one backend per point)."""
    path = directory / f"{name}.toml"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.toml"))
        raise ValueError(f"unknown twin profile {name!r} (known: {', '.join(known)})")
    with path.open("rb") as f:
        data = tomllib.load(f)
    return Profile(name, data, load_kernels(directory / data["kernels"]["dir"]))
