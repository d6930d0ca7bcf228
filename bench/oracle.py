"""Oracle comparison on the 4090 twin: adaptive (default config) against the best hand-tuned fixed caps.

For each point, policy `fixed` runs every config of a grid: prefill token budget x decode batch cap x
KV reservation ratio (1.0 = whole-request, the seed's; 0.0 = prompt only with preemption, vLLM's), on
the scheduler a modern engine would use (mixed prefill/decode steps, decode first, chunked prefill).
The oracle is the best config that finished every request with 0 OOMs -- a per-point choice no single
static config makes. Closed loop as in `headroom bench matrix`; all numbers are twin numbers.

    python -m bench.oracle --jobs 2 --out bench/results/oracle.md
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from itertools import product

from bench.cli import run_point
from bench.harness.report import Stamp, write_report
from bench.harness.twin_flags import add_twin_sensors, twin_argv
from engine.cli import engine_config

POINTS = [(1, 4096, 1024), (4, 4096, 1024), (16, 256, 1024), (16, 32, 4096), (64, 32, 1024), (64, 256, 256)]
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
DECODE_SEQS = (8, 16, 32, 64, 128)
KV_RATIOS = (1.0, 0.0)
TARGET = 0.9
# Every run gets the seed's hand-set pool: without --num-blocks adaptive would size its own and
# hold KV the fixed configs lack, which is bench/results/kv_pool.md's comparison, not this one.
NUM_BLOCKS = "64"


def fixed_argv(prefill: int, decode: int, ratio: float) -> list[str]:
    return [
        "--max-prefill-tokens",
        str(prefill),
        "--max-decode-seqs",
        str(decode),
        "--max-num-seqs",
        "256",
        "--kv-reserve-ratio",
        str(ratio),
        "--fixed-steps",
        "mixed",
    ]


def one(job: tuple[tuple[int, int, int], str, list[str], list[str]]) -> dict:
    point, policy, argv, twin = job
    m = run_point(engine_config([*twin, "--num-blocks", NUM_BLOCKS, "--policy", policy, *argv]), point)
    m["argv"] = " ".join(argv)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="markdown report; every run goes beside it as .json")
    add_twin_sensors(ap)
    args = ap.parse_args()
    stamp = Stamp("python -m bench.oracle")
    twin = twin_argv(args)
    jobs = [(p, "adaptive", [], twin) for p in POINTS] + [
        (p, "fixed", fixed_argv(*cfg), twin) for p in POINTS for cfg in product(PREFILL_TOKENS, DECODE_SEQS, KV_RATIOS)
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(one, jobs))
    lines = [
        "# Oracle comparison on the 4090 twin (twin numbers, virtual time)",
        "",
        f"Grid per point ({len(jobs) // len(POINTS) - 1} fixed configs): prefill tokens {PREFILL_TOKENS} x decode "
        f"seqs {DECODE_SEQS} x KV reservation ratio {KV_RATIOS}; mixed steps, decode first, chunked prefill, "
        f"max 256 running, {NUM_BLOCKS} KV blocks for every run. Oracle = the best fixed config with 0 OOMs and 0 "
        "failed requests. Adaptive preempts by swap (its default), the fixed configs by recompute.",
        "",
        "| con | in | out | adaptive out tok/s | oracle out tok/s | oracle config | adaptive / oracle | "
        "fixed configs that OOMed | adaptive TTFT mean ms | oracle TTFT mean ms | adaptive E2EL mean s | "
        "oracle E2EL mean s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fractions = []
    for p in POINTS:
        mine = [r for r in runs if (r["concurrency"], r["input_len"], r["output_len"]) == p]
        ad = next(r for r in mine if r["policy"] == "adaptive")
        fixed = [r for r in mine if r["policy"] == "fixed"]
        clean = [r for r in fixed if r["ooms"] == 0 and r["failed"] == 0]
        best = max(clean, key=lambda r: r["output_throughput"])
        frac = ad["output_throughput"] / best["output_throughput"]
        fractions.append(frac)
        lines.append(
            f"| {p[0]} | {p[1]} | {p[2]} | {ad['output_throughput']:.1f} | {best['output_throughput']:.1f} | "
            f"`{best['argv']}` | {frac:.3f} | {sum(r['ooms'] > 0 for r in fixed)} / {len(fixed)} | "
            f"{ad['mean_ttft_ms']:.0f} | {best['mean_ttft_ms']:.0f} | {ad['mean_e2el_ms'] / 1e3:.1f} | "
            f"{best['mean_e2el_ms'] / 1e3:.1f} |"
        )
    lines += [
        "",
        f"Adaptive OOMs: {sum(r['ooms'] for r in runs if r['policy'] == 'adaptive')}; "
        f"minimum adaptive / oracle {min(fractions):.3f} (target {TARGET}): "
        f"{'met' if min(fractions) >= TARGET else 'NOT met'} at every point."
        if min(fractions) >= TARGET
        else f"minimum adaptive / oracle {min(fractions):.3f} (target {TARGET}): NOT met at "
        f"{sum(f < TARGET for f in fractions)} of {len(POINTS)} points.",
    ]
    write_report(args.out, lines, stamp, runs)


if __name__ == "__main__":
    main()
