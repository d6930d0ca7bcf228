"""The machine a wall-time result was measured on, in one line: CPU model, the flags that choose the
kernels, cores, load average, Python and torch. Wall-time numbers mean little without it; twin (virtual
time) results do not need it."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from engine.model.dtype_choice import read_cpu_facts

# The vector and matrix units the CPU kernels and oneDNN pick their code paths by.
KERNEL_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@dataclass(frozen=True)
class Machine:
    cpu: str
    flags: tuple[str, ...]  # the KERNEL_FLAGS this CPU has, in that order
    cores: int
    python: str
    torch: str


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> Machine:
    facts = read_cpu_facts()
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    return Machine(
        cpu=facts.model or platform.machine() or "unknown",
        flags=tuple(f for f in KERNEL_FLAGS if f in facts.flags),
        cores=os.cpu_count() or 0,
        python=platform.python_version(),
        torch=torch_version,
    )


def machine_line(load_before: str | None = None) -> str:
    """`Machine: ...` for a report; with `load_before`, the load average before the run and now, after it."""
    m = machine()
    load = f"{load_before} before, {load_average()} after" if load_before else load_average()
    flags = " ".join(m.flags) or "none of " + " ".join(KERNEL_FLAGS)
    return f"Machine: {m.cpu}, {m.cores} CPUs, flags {flags}; Python {m.python}, torch {m.torch}; load average {load}."
