"""The quantized kernel (engine/model/csrc/qlinear.cpp) built with some of its constants changed, and timed on
what a decode step streams through it: every packed linear of a model in layer order, then its LM head."""

from __future__ import annotations

import ctypes
import re
import shutil
import time
from pathlib import Path

import torch

from engine.backends.torch_backend import TorchBackend
from engine.model.cpu_kernels import CSRC, build
from engine.model.quant import packed_shape

QLINEAR_ARGS = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
]  # fmt: skip


def variant_library(workdir: Path, tag: str, constants: dict[str, int], drop: str | None = None) -> ctypes.CDLL:
    """The kernels built from a copy of the sources whose qlinear.cpp has `constexpr ... NAME = value;` for each
    of `constants`, and no line matching `drop` (a regular expression)."""
    csrc = workdir / f"csrc-{tag}"
    shutil.copytree(CSRC, csrc)
    source = (csrc / "qlinear.cpp").read_text()
    for name, value in constants.items():
        pattern = re.compile(rf"(constexpr \w+ {name} = )\d+;")
        assert pattern.search(source), f"qlinear.cpp no longer declares {name}"
        source = pattern.sub(rf"\g<1>{value};", source)
    if drop is not None:
        source = re.sub(rf"\n[^\n]*{drop}[^\n]*", "", source)
    (csrc / "qlinear.cpp").write_text(source)
    built = build(workdir / "cache", csrc=csrc)
    assert built.library is not None, built.reason
    built.library.headroom_qlinear.argtypes = QLINEAR_ARGS
    return built.library


def weight_stream(backend: TorchBackend) -> list[torch.Tensor]:
    """The packed weights a decode step reads, in the order it reads them."""
    model = backend.model
    weights = [*(w for layer in model.layers for w in layer.packed), model.packed_head]
    assert all(isinstance(w, torch.Tensor) for w in weights), "the model's linears are not all quantized"
    return weights  # type: ignore[return-value]


def sweep_seconds(lib: ctypes.CDLL, weights: list[torch.Tensor], rows: int, calls: int) -> float:
    """Seconds for one pass over `weights` with `rows` fp32 rows, the mean of `calls` passes."""
    shapes = [packed_shape(w) for w in weights]
    x = torch.randn(rows, max(k for _, k, _ in shapes), generator=torch.Generator().manual_seed(0))
    out = torch.empty(rows, max(n for n, _, _ in shapes))
    threads = torch.get_num_threads()
    args = [
        (0, x.data_ptr(), x.shape[1], w.data_ptr(), bits, 0, out.data_ptr(), rows, n, k, 0, threads)
        for w, (n, k, bits) in zip(weights, shapes, strict=True)
    ]
    for a in args:  # warm-up: pages in, the library's first calls
        lib.headroom_qlinear(*a)
    start = time.perf_counter()
    for _ in range(calls):
        for a in args:
            lib.headroom_qlinear(*a)
    return (time.perf_counter() - start) / calls
