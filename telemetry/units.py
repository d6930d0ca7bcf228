"""Byte units (KIB, MIB, GIB, TIB), and byte sizes as people write them on a command line ("2GiB", "1.5GiB",
"512MiB", "1e9", 4096) -> int.

Kept here (not in engine/) because probes and metrics talk bytes and `--device-memory` feeds a probe.
"""

from __future__ import annotations

import re

# The binary units, the one place they are defined: every module that turns bytes into MiB or GiB imports
# these. Ints, so `n * MIB` stays a whole number of bytes; `x / MIB` is float division all the same.
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    # IEC (binary) units, what memory sizes are normally meant in.
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    # Bare letters follow the docker/k8s-memory habit: binary.
    "k": KIB,
    "m": MIB,
    "g": GIB,
    "t": TIB,
    # SI (decimal) units, for when someone copies a marketing number.
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Parse a size to whole bytes. "1.5GiB" -> 1610612736; "2GB" is decimal, "2G" and "2GiB" binary.

    Raises ValueError on anything else (negative, unknown unit, garbage) so a typo in a flag fails
    at startup instead of silently emulating a tiny device.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"negative byte size: {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value == float("inf"):
            raise ValueError(f"not a byte size: {value!r}")
        return int(value)
    match = _PATTERN.match(value)
    if match is None:
        raise ValueError(f"not a byte size: {value!r}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown byte unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(number) * factor) if "." in number or "e" in number.lower() else int(number) * factor


def format_bytes(n: int | float) -> str:
    """Human-readable binary size for logs ("1.50 GiB")."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"
