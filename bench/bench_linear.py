"""The bf16 linear kernel (engine/model/csrc/linear.cpp) against oneDNN's prepacked linear, as the model ran it
before (inputs padded to BF16_MIN_ROWS rows), on the default model's shapes: microseconds per call, weight
GB/s and GFLOP/s, for several row counts. Each timing cycles over COPIES copies of the weight (about the
L3's size for the smaller shapes), so that a call mostly reads its weight from memory, as in a step where
every layer's weights come once.

    LD_PRELOAD=.venv/lib/libiomp5.so python -m bench.bench_linear --rows 1,4,16,64,256,2048
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from bench.harness.machine import load_average, machine_line
from engine.model.batch_invariance import BF16_MIN_ROWS, padded_linear, prepacked
from engine.model.cpu_kernels import linear_unusable_reason, pack_linear

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))  # (in, out): qkv, o, gate_up, down, head
COPIES = 30


def seconds_per_call(x: torch.Tensor, weights: list, min_rows: int, calls: int) -> float:
    padded_linear(x, weights[0], min_rows)
    start = time.perf_counter()
    for i in range(calls):
        padded_linear(x, weights[i % len(weights)], min_rows)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,256,2048")
    args = parser.parse_args()
    if (why := linear_unusable_reason(torch.bfloat16)) is not None:
        sys.exit(f"the bf16 linear kernel does not run here: {why}")
    load_before = load_average()
    print(f"{machine_line()} {torch.get_num_threads()} threads.\n")
    print("| rows | in -> out | oneDNN us | ours us | oneDNN GB/s | ours GB/s | oneDNN GFLOP/s | ours GFLOP/s", end="")
    print(" | oneDNN / ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for rows, (k, n) in itertools.product((int(r) for r in args.rows.split(",")), SHAPES):
        weights = [torch.randn(n, k, generator=g).bfloat16() for _ in range(COPIES if n < 49152 else 3)]
        theirs, ours = [prepacked(w) for w in weights], [pack_linear(w) for w in weights]
        x = torch.randn(rows, k, generator=g).bfloat16()
        calls = max(3, 2000 // rows)
        t_theirs = seconds_per_call(x, theirs, BF16_MIN_ROWS, calls)  # padded, as the model ran oneDNN
        t_ours = seconds_per_call(x, ours, 1, calls)
        gb, flop = n * k * 2 / 1e9, 2 * rows * n * k / 1e9
        print(
            f"| {rows} | {k} -> {n} | {t_theirs * 1e6:.1f} | {t_ours * 1e6:.1f} | {gb / t_theirs:.1f} | "
            f"{gb / t_ours:.1f} | {flop / t_theirs:.0f} | {flop / t_ours:.0f} | {t_theirs / t_ours:.2f} |",
            flush=True,
        )
    print(f"\n{machine_line(load_before)}")


if __name__ == "__main__":
    main()
