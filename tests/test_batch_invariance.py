"""The linear kernels' batch-invariance probe, and the padding the engine applies where it is needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.batch_invariance import BF16_MIN_ROWS, linear_min_rows, linear_row_mismatch, padded_linear

SHAPES = [(64, 48), (96, 32)]


def test_padding_keeps_the_rows_and_their_values():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g)
    out = padded_linear(x, w, min_rows=8)
    assert out.shape == (3, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w))


def row_by_row(x: torch.Tensor, w: torch.Tensor, min_rows: int) -> torch.Tensor:
    """A kernel invariant by construction: every row is computed on its own."""
    return torch.cat([F.linear(row[None], w) for row in x])


def row_count_dependent(x: torch.Tensor, w: torch.Tensor, min_rows: int) -> torch.Tensor:
    """A kernel that, like MKL's sgemm, rounds differently once it gets 5 or more rows."""
    out = row_by_row(x, w, min_rows)
    return out + 1e-3 if x.shape[0] >= 5 else out


def test_probe_finds_a_kernel_that_depends_on_the_row_count():
    found = linear_row_mismatch(SHAPES, torch.float32, rows=range(1, 9), linear=row_count_dependent)
    assert found is not None and "64->48" in found and "batch of 5" in found


def test_probe_passes_a_row_invariant_kernel():
    assert linear_row_mismatch(SHAPES, torch.float32, rows=range(1, 20), linear=row_by_row) is None


def test_only_cpu_bf16_is_padded():
    assert linear_min_rows(torch.device("cpu"), torch.bfloat16) == BF16_MIN_ROWS
    assert linear_min_rows(torch.device("cpu"), torch.float32) == 1
    assert linear_min_rows(torch.device("cuda"), torch.bfloat16) == 1
