"""Triton's paged decode kernel (engine/model/triton_decode.py), which decode CUDA graphs capture where flash-attn
is not installed: against a float64 reference, and through the graph path of the tiny model, in Triton's CPU
interpreter (tests/triton_cases.py, in a process of its own). The compiled kernel runs under the `cuda` marker
(tests/test_cuda_graphs.py) and in bench/device_check.sh."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from engine.model.triton_decode import triton_unusable_reason


def test_the_kernel_matches_float64_and_the_eager_tokens_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "tests.triton_cases"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("relative error") == 3 and "tokens equal: True" in run.stdout


def test_the_kernel_runs_only_where_it_can() -> None:
    cuda = torch.device("cuda", 0)
    assert triton_unusable_reason(torch.device("cpu"), 64, 16) == "Triton's decode kernel needs CUDA, device is cpu"
    assert triton_unusable_reason(cuda, 64, 16) is None
    assert "head size, got 80" in triton_unusable_reason(cuda, 80, 16)
    assert "block size, got 8" in triton_unusable_reason(cuda, 64, 8)
