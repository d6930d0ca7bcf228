"""Where the quantized kernel should switch from its AVX512-VNNI tiles to AMX-INT8 (engine/model/csrc/qlinear.cpp,
`AMX_MIN_ROWS`; issue #46): the kernel built twice, AMX from one row and AMX never, timed by rows on what a
decode step streams through its linears (every packed linear of the default model, then the tied LM head), in
alternated rounds. Needs a CPU with AMX-INT8 and a kernel that grants it.

    python -m bench.amx_rows --out bench/results/amx_rows.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.harness.machine import load_average, machine_line
from bench.harness.qlinear_sweep import sweep_seconds, variant_library, weight_stream
from bench.harness.report import Stamp, write_report
from engine.backends.torch_backend import TorchBackend
from engine.model.cpu_kernels import QLINEAR_ISAS, qlinear_isa

NEVER = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if qlinear_isa() != QLINEAR_ISAS[3]:
        sys.exit(f"this kernel runs {qlinear_isa()}: no AMX-INT8 to compare")
    stamp, load_before = Stamp("python -m bench.amx_rows"), load_average()
    rows = [int(r) for r in args.rows.split(",")]
    weights = weight_stream(TorchBackend("default", dtype="float32", device="cpu", num_blocks=16))
    paths = {"AVX512-VNNI": {"AMX_MIN_ROWS": NEVER}, "AMX-INT8": {"AMX_MIN_ROWS": 1}}
    seconds: dict[tuple[str, int], list[float]] = {(p, m): [] for p in paths for m in rows}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {p: variant_library(Path(tmp), p, constants) for p, constants in paths.items()}
        for r in range(args.rounds):
            for m in rows:
                for p in list(paths)[r % 2 :] + list(paths)[: r % 2]:
                    seconds[p, m].append(sweep_seconds(libs[p], weights, m, max(2, 32 // m)))
    med = statistics.median
    table = []
    for m in rows:
        vnni, amx = med(seconds["AVX512-VNNI", m]), med(seconds["AMX-INT8", m])
        table.append(f"| {m} | {1e3 * vnni:.2f} | {1e3 * amx:.2f} | {vnni / amx:.2f} |")
    lines = [
        "# AVX512-VNNI against AMX-INT8 in the quantized kernel, by rows (this CPU)",
        "",
        machine_line(load_before),
        "",
        f"- One sweep: the default model's {len(weights)} packed linears and the tied LM head, fp32 rows, "
        f"{torch.get_num_threads()} threads; {args.rounds} rounds, the two builds alternated; medians.",
        "",
        "| rows | VNNI ms a sweep | AMX ms a sweep | VNNI / AMX |",
        "|---|---|---|---|",
        *table,
    ]
    data = {"rows": rows, "seconds": {f"{p}@{m}": s for (p, m), s in seconds.items()}}
    write_report(args.out, lines, stamp, data)


if __name__ == "__main__":
    main()
