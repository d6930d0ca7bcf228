"""Batch invariance of the model's linear layers on CPU: does a row's output depend on how many rows come
with it?

Greedy outputs are bitwise the same alone and batched only if every op computes a token's row the same
way whatever the batch holds. Attention and the elementwise ops are written for that (engine/model/cpu_kernels.py
and, in plain torch, engine/model/attention.py); so do the linears on Headroom's kernels (`linear_weight`): bf16
on a CPU with AVX512-BF16 (AMX CPUs have it too, engine/model/csrc/linear.cpp), fp32 on one with AVX2
(linear_f32.cpp), and quantized weights on every CPU (qlinear.cpp), each summing an output in one fixed order.
Elsewhere the linears run on vendor kernels that promise nothing of the kind. What they do is in
bench/results/batch_invariance.md, and the choices here follow from it:
- bf16 (oneDNN): a row computed alone takes a single-row kernel that can round it differently from the same
  row in a batch. Padding every input to `BF16_MIN_ROWS` rows keeps that kernel out of the way, for little
  (the step streams the same weights). oneDNN does not guarantee it, so `linear_row_mismatch` checks it
  where it matters (tests/test_engine_model.py).
- bf16 without oneDNN's bf16 kernels (ONEDNN_MAX_CPU_ISA=AVX2, as on AVX2-only CPUs): torch's own kernel
  keeps rows apart, padded or not.
- fp32 on MKL's sgemm (where Headroom's fp32 kernel does not run: no AVX2, or the C++ kernels off): the kernel
  changes with the row count at several sizes up to 16 rows, and padding to 16 would make a batch-1 linear
  several times slower, so it is left unpadded and is not batch-invariant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import PackedLinear, cpu_linear, cpu_qlinear, pack_linear
from engine.model.dtype_choice import onednn_runs_bf16
from engine.model.quant import is_packed

BF16_MIN_ROWS = 2
# Batch sizes the probe compares: every small one (where kernels switch by row count) and a few large.
PROBE_ROWS = (*range(1, 33), 47, 64, 129, 256)
# Rows the probe checks in each batch: these first ones, and the batch's last row.
PROBE_FIRST_ROWS = 16


def linear_min_rows(device: torch.device, dtype: torch.dtype) -> int:
    """Rows the model pads each linear's input to (1: no padding). Only CPU bf16 pads: there it costs
    little (the step reads the same weights) and keeps oneDNN's single-row kernel, which rounds differently,
    out of the way."""
    return BF16_MIN_ROWS if device.type == "cpu" and dtype == torch.bfloat16 else 1


def prepacked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout where the model's linears run on oneDNN (CPU bf16), else itself.
    An unpacked weight is reordered into that layout on every call, which at decode sizes costs about as much
    as the matmul itself; prepacked, it is reordered once. The kernel is the same, so every output is bitwise
    F.linear's.
    fp32 stays unpacked: F.linear takes MKL there, and oneDNN's fp32 kernel rounds differently; so does bf16
    where oneDNN has no bf16 kernel (an AVX2-only CPU: torch's own kernel runs it)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not onednn_runs_bf16():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear_weight(weight: torch.Tensor, cpu_kernel: bool) -> torch.Tensor | PackedLinear:
    """`weight` as the model's linear runs it: packed for Headroom's bf16 kernel where `cpu_kernel` (the
    backend found it usable: engine/model/cpu_kernels.py `linear_unusable_reason`) and the shape fits, else
    `prepacked`. A quantized weight (packed bytes, engine/model/quant.py) is already in its kernel's layout."""
    if is_packed(weight):
        return weight
    packed = pack_linear(weight) if cpu_kernel else None
    return packed if packed is not None else prepacked(weight)


def padded_linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear, min_rows: int = 1) -> torch.Tensor:
    """F.linear(x, weight) for x [T, K], computed over at least `min_rows` rows (zeros appended), so that
    the kernel, and with it each row's summation order, is the one a batch of `min_rows` rows gets.
    `weight` may be `prepacked`, a PackedLinear or quantized bytes, whose kernels need no padding."""
    if isinstance(weight, PackedLinear):
        return cpu_linear(x, weight)
    if is_packed(weight):
        return cpu_qlinear(x, weight)
    rows = x.shape[0]
    if rows < min_rows:
        padded = _zero_rows(min_rows, x.shape[1], x.dtype, x.device)
        padded[:rows] = x  # rows past `rows` are never written: they stay zero
        return _linear(padded, weight)[:rows]
    return _linear(x, weight)


@functools.cache
def _zero_rows(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer padded_linear copies short inputs into, one per shape: one copy a call instead of F.pad's
    allocate, fill and copy, for every linear of every layer of a batch-1 decode step. The engine runs one step at a
    time, and the linear's output is a new tensor, so reusing it is safe. Made outside inference mode, so
    that it can be written in and out of it."""
    with torch.inference_mode(False):
        return torch.zeros(rows, width, dtype=dtype, device=device)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def linear_row_mismatch(
    shapes: Iterable[tuple[int, int]],
    dtype: torch.dtype,
    min_rows: int = 1,
    rows: Iterable[int] = PROBE_ROWS,
    linear: Callable[[torch.Tensor, Any, int], torch.Tensor] = padded_linear,
    cpu_kernel: bool = False,
) -> str | None:
    """Probe the kernels on CPU: for each (in_features, out_features) shape, compute random rows one at a
    time and in batches of each size in `rows` (the first PROBE_FIRST_ROWS rows and the last row of each
    batch are compared). `cpu_kernel`: the weights as `linear_weight` packs them. None when every row
    matched bitwise; else the first shape, batch size and rows that differed."""
    g = torch.Generator().manual_seed(0)
    rows = sorted(rows)
    checked = sorted({*range(min(PROBE_FIRST_ROWS, rows[-1])), *(m - 1 for m in rows)})
    for k, n in shapes:
        weight = linear_weight(torch.randn(n, k, generator=g).to(dtype), cpu_kernel)  # as the model runs them
        x = torch.randn(rows[-1], k, generator=g).to(dtype)
        alone = {i: linear(x[i : i + 1], weight, min_rows)[0] for i in checked}
        for m in rows:
            batched = linear(x[:m], weight, min_rows)
            differ = [i for i in checked if i < m and not torch.equal(batched[i], alone[i])]
            if differ:
                return f"{dtype} linear {k}->{n}, min_rows {min_rows}: rows {differ[:8]} of a batch of {m} differ"
    return None
