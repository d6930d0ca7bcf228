"""Which linear kernels are batch-invariant on this CPU: engine/model/batch_invariance.py's probe on the default
model's shapes, for fp32 and bf16, unpadded and padded to several row counts. Prints a markdown table
(the first mismatch found, or "invariant") and the facts `--dtype auto` decides from.

    python -m bench.batch_invariance
    # an AVX2-only CPU, emulated:
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python -m bench.batch_invariance
"""

from __future__ import annotations

import time

import torch

from bench.harness.machine import machine_line
from engine.model.batch_invariance import linear_row_mismatch
from engine.model.dtype_choice import choose_dtype, read_cpu_facts
from engine.model.loaders import load

MIN_ROWS = (1, 2, 8, 16)


def main() -> None:
    facts = read_cpu_facts()
    print(machine_line())
    print(f"ATen capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print(f"--dtype auto: {choose_dtype('auto', torch.device('cpu'), facts)}")
    print()
    shapes = load("default").model.linear_shapes()
    print(f"linear shapes (in, out): {shapes}\n")
    print("| dtype | min_rows | probe | seconds |\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for min_rows in MIN_ROWS:
            t0 = time.perf_counter()
            found = linear_row_mismatch(shapes, dtype, min_rows) or "invariant"
            print(f"| {dtype} | {min_rows} | {found} | {time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
