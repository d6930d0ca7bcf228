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
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.bandwidth_bound import read_bandwidth
from bench.harness.machine import load_average, machine_line
from bench.harness.qlinear_sweep import sweep_seconds, variant_library, weight_stream
from bench.harness.report import Stamp, write_report
from engine.backends.torch_backend import TorchBackend
from engine.model.cpu_kernels import qlinear_isa

CALLS = 40  # sweeps timed together in a round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distances", default="0,2048,4096,8192,16384,32768", help="bytes ahead, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp, load_before = Stamp("python -m bench.prefetch_distance"), load_average()
    distances = [int(d) for d in args.distances.split(",")]
    weights = weight_stream(TorchBackend("default", dtype="float32", device="cpu", num_blocks=16))
    total = sum(w.numel() * w.element_size() for w in weights)
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            d: variant_library(Path(tmp), str(d), {"PREFETCH": d}, drop=None if d else r"prefetch_ahead<BITS>\(")
            for d in distances
        }
        seconds: dict[int, list[float]] = {d: [] for d in distances}
        bandwidth = []
        for r in range(args.rounds):
            bandwidth.append(read_bandwidth(cores))
            for d in distances[r % len(distances) :] + distances[: r % len(distances)]:
                seconds[d].append(sweep_seconds(libs[d], weights, 1, CALLS))
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
