"""The CLI's re-execution with Intel OpenMP preloaded (engine/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import openmp


def test_preload_env_prepends_the_library_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(openmp, "intel_openmp", lambda: lib)
    env = openmp.preload_env({"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env is not None and env["LD_PRELOAD"] == f"{lib} /other.so" and env[openmp.ENV] == "1"
    assert env["PATH"] == "/bin"
    assert openmp.preload_env(env) is None  # the re-executed process does not loop
    assert openmp.preload_env({openmp.ENV: "0"}) is None  # opted out
    assert openmp.preload_env({"LD_PRELOAD": str(lib)}) is None  # preloaded by the user already
    monkeypatch.setattr(openmp, "intel_openmp", lambda: None)
    assert openmp.preload_env({}) is None  # not installed: run as is


@pytest.mark.skipif(openmp.intel_openmp() is None, reason="intel-openmp is an x86-64 dependency; not installed here")
def test_reexec_maps_intel_openmp_into_the_process() -> None:
    code = (
        "from engine.openmp import reexec_with_intel_openmp; reexec_with_intel_openmp(); "
        "print(any('libiomp5' in line for line in open('/proc/self/maps')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in (openmp.ENV, "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
