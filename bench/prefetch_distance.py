"""How far ahead the quantized kernel (engine/model/csrc/qlinear.cpp, `PREFETCH`) should ask for the weight
records it reads next (issue #46): the kernel built with each distance (0: no software prefetch), timed on what
a batch-1 decode step streams, every packed linear of the default model in layer order and then the tied LM
head, one row each, in alternated rounds. Weight GB/s is those bytes over the time; the memory's own read
bandwidth (bench/bandwidth_bound.py) is measured in the same rounds. Honours HEADROOM_CPU_ISA (the AVX2 path
on a CPU with AVX-512).

    python -m bench.prefetch_distance --out bench/results/prefetch_distance.md
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bandwidth_bound import read_bandwidth
from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from engine.backends.torch_backend import TorchBackend
from engine.model.cpu_kernels import CSRC, build, qlinear_isa
from engine.model.quant import packed_shape

PREFETCH = re.compile(r"constexpr int64_t PREFETCH = \d+;")
CALLS = 40  # sweeps timed together in a round


def library_with(distance: int, workdir: Path) -> ctypes.CDLL:
    """The kernels built from a copy of the sources with PREFETCH = distance (0 drops the prefetch calls)."""
    csrc = workdir / f"csrc-{distance}"
    shutil.copytree(CSRC, csrc)
    source = (csrc / "qlinear.cpp").read_text()
    assert PREFETCH.search(source), "qlinear.cpp no longer declares PREFETCH"
    source = PREFETCH.sub(f"constexpr int64_t PREFETCH = {distance};", source)
    if distance == 0:
        source = re.sub(r"\n\s*prefetch_ahead<BITS>\([^)]*\);", "", source)
    (csrc / "qlinear.cpp").write_text(source)
    built = build(workdir / "cache", csrc=csrc)
    assert built.library is not None, built.reason
    return built.library


def weight_stream(backend: TorchBackend) -> list:
    """The packed weights a decode step reads, in the order it reads them."""
    model = backend.model
    layers = [w for layer in model.layers for w in layer.packed]
    return [*layers, model.packed_head]


def sweep_seconds(lib: ctypes.CDLL, weights: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> float:
    """Seconds for one pass over `weights` with one row, the mean of CALLS passes."""
    args = []
    for w in weights:
        n, k, bits = packed_shape(w)
        args.append((0, x.data_ptr(), k, w.data_ptr(), bits, 0, out.data_ptr(), 1, n, k, 0, torch.get_num_threads()))
    start = time.perf_counter()
    for _ in range(CALLS):
        for a in args:
            lib.headroom_qlinear(*a)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distances", default="0,2048,4096,8192,16384,32768", help="bytes ahead, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp, load_before = Stamp("python -m bench.prefetch_distance"), load_average()
    distances = [int(d) for d in args.distances.split(",")]
    backend = TorchBackend("default", dtype="float32", device="cpu", num_blocks=16)
    weights = weight_stream(backend)
    assert all(isinstance(w, torch.Tensor) for w in weights), "the default model's linears are not all quantized"
    total = sum(w.numel() * w.element_size() for w in weights)
    width = max(packed_shape(w)[1] for w in weights)
    x, out = torch.randn(1, width), torch.empty(1, max(packed_shape(w)[0] for w in weights))
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        libs = {d: library_with(d, Path(tmp)) for d in distances}
        for lib in libs.values():
            lib.headroom_qlinear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                             ctypes.c_int, ctypes.c_int]  # fmt: skip
            sweep_seconds(lib, weights, x, out)  # warm-up
        seconds: dict[int, list[float]] = {d: [] for d in distances}
        bandwidth = []
        for r in range(args.rounds):
            bandwidth.append(read_bandwidth(cores))
            for d in distances[r % len(distances) :] + distances[: r % len(distances)]:
                seconds[d].append(sweep_seconds(libs[d], weights, x, out))
    med = statistics.median
    rows = [
        f"| {d} | {1e3 * med(s):.3f} ({1e3 * min(s):.3f}-{1e3 * max(s):.3f}) | {total / med(s) / 1e9:.1f} | "
        f"{total / med(s) / med(bandwidth):.2f} |"
        for d, s in seconds.items()
    ]
    lines = [
        "# Prefetch distance of the quantized kernel, batch 1 (this CPU)",
        "",
        machine_line(load_before),
        "",
        f"- The kernel's vector path: {qlinear_isa()}; HEADROOM_CPU_ISA={os.environ.get('HEADROOM_CPU_ISA', '')!r}.",
        f"- One sweep: the default model's {len(weights)} packed linears (every layer's, then the tied LM head), "
        f"{total / 2**20:.1f} MiB, one fp32 row each, {torch.get_num_threads()} threads; {CALLS} sweeps a "
        f"round, {args.rounds} rounds, the distances in a rotated order each round.",
        f"- Read bandwidth of cores {cores} (bench/bandwidth_bound.py), same rounds: median "
        f"{med(bandwidth) / 1e9:.1f} GB/s (range {min(bandwidth) / 1e9:.1f}-{max(bandwidth) / 1e9:.1f}).",
        "",
        "| distance (bytes; 0: none) | ms a sweep, median (range) | weight GB/s | of the read bandwidth |",
        "|---|---|---|---|",
        *rows,
    ]
    data = {"distances": distances, "seconds": seconds, "bandwidth": bandwidth, "bytes": total}
    write_report(args.out, lines, stamp, data)


if __name__ == "__main__":
    main()
