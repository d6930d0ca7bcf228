"""Which linear kernels are batch-invariant on this CPU: engine/model/batch_invariance.py's probe on the default
model's shapes, for fp32 and bf16, unpadded and padded to several row counts. Prints a markdown table
(the first mismatch found, or "invariant") and the facts `--dtype auto` decides from.

    .venv/bin/python bench/batch_invariance.py
    # an AVX2-only CPU, emulated:
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python bench/batch_invariance.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.batch_invariance import linear_row_mismatch  # noqa: E402
from engine.model.dtype_choice import choose_dtype, read_cpu_facts  # noqa: E402
from engine.model.loaders import load  # noqa: E402

MIN_ROWS = (1, 2, 8, 16)


def main() -> None:
    facts = read_cpu_facts()
    print(
        f"CPU: {facts.summary()}; torch {torch.__version__}, ATen capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    print(f"--dtype auto: {choose_dtype('auto', torch.device('cpu'), facts)}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}\n")
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
