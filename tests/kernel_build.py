"""How a test treats the C++ CPU kernels' build (engine/model/cpu_kernels.py): a build that fails where a
compiler exists is a defect in the sources and fails the test; a machine without a compiler is one the
server runs in plain torch by design, so a test of the kernels themselves skips there, with the reason."""

from __future__ import annotations

import pytest

from engine.model import cpu_kernels
from engine.model.cpu_kernels import KernelBuild


def fail_on_broken_build(result: KernelBuild | None = None) -> None:
    """Fail where a compiler was found and the kernels did not build (default: this process's build)."""
    result = result or cpu_kernels.load_library()
    if result.failed:
        pytest.fail(f"the C++ CPU kernels failed to build with a compiler present: {result.reason}", pytrace=False)


def require_cpu_kernels(result: KernelBuild | None = None) -> None:
    """For a test of the kernels themselves: fail on a broken build, skip where they cannot be built."""
    result = result or cpu_kernels.load_library()
    fail_on_broken_build(result)
    if result.library is None:
        pytest.skip(f"the CPU kernels cannot be built here: {result.reason}")
