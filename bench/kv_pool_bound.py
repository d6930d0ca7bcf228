"""Each matrix point's physical bound on the twin for a KV pool of N blocks, and how close a run came.

Why: a throughput target over the out=4096 points needs to know what the pool allows; this separates that
from what the scheduler makes of it. The bound is a fluid one, for any schedule, with the kernel tables' times:
- a request of `in` prompt and `out` output tokens holds ceil((in + o + 1) / block) blocks at its o-th
  decode, so n requests need n x sum_o of that in block-steps; a pool of N blocks runs at most N a step,
  and a client's requests run one after another, so decode steps S >= max(n x blocks / N, out x n / con);
- the S steps decode n x out tokens, a mean batch of b = n x out / S at the mean context in + out / 2;
  a decode step's time is affine in its batch, so S steps take at least S x t(b) (t: the kernel table's
  decode step at the smallest CUDA graph >= b);
- every prompt token costs at least the table's best marginal prefill rate: a lone 2048-token prefill
  step (the seed's logits for every prompt token included) less a lone decode step, per token;
- recomputes after preemption, chunking and stragglers cost nothing here, so the bound is optimistic.
Output throughput <= n x out / (S x t(b) + n x in x prefill time per token).

The largest pool any policy can hold is what the card has beside the engine's idle footprint with no
headroom, no reserve and no activations at all: the start-up sizing's capacity less memory outside the
allocator and the idle footprint without the pool, in blocks. Its column bounds every pool policy.

    python -m bench.kv_pool_bound --run bench/results/matrix/adaptive_sized.json --out bench/results/kv_pool_bound.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.harness.report import Stamp, write_report
from bench.seed_matrix import MATRIX_DIR, Point, geomean, load_matrix, num_requests
from engine.backends.twin.backend import as_twin
from engine.backends.twin.latency import LatencyModel, StepWork
from engine.cli import engine_config
from engine.factory import build_engine

ROOT = Path(__file__).resolve().parents[1]
PREFILL_CHUNK = 2048


def block_steps(inp: int, out: int, block: int) -> int:
    """Blocks held, summed over a request's decode steps."""
    return sum(-(-(inp + o + 1) // block) for o in range(out))


def prefill_seconds_per_token(latency: LatencyModel, chunk: int = PREFILL_CHUNK) -> float:
    """The table's best marginal prefill cost: a lone chunk, less the decode step it displaces."""
    step = latency.step_time(StepWork(((chunk, 0),), logits_rows=chunk, sampled=1))
    return (step - latency.decode_step_time(1, chunk, 1, 1)) / chunk


def point_bound(latency: LatencyModel, point: Point, n: int, pool: int, block: int) -> float:
    """Output tokens per second no schedule exceeds at `point` with `n` requests and `pool` blocks."""
    con, inp, out = point
    steps = max(n * block_steps(inp, out, block) / pool, out * math.ceil(n / con))
    batch = max(1, round(n * out / steps))
    decode = steps * latency.decode_step_time(batch, batch * (inp + out // 2), batch, batch)
    return n * out / (decode + n * inp * prefill_seconds_per_token(latency))


def largest_pool(sensors: str) -> tuple[int, int, LatencyModel]:
    """(blocks the card holds beside the idle footprint, block size, latency model) of the default twin with
    `sensors` (realistic ones hold CUDA graph memory beside the idle footprint)."""
    engine = build_engine(engine_config(["--backend", "twin", "--twin-sensors", sensors]))
    s = engine.policy.state()["kv_pool"]["start_up"]
    free = s["capacity"] - s["external"] - s["idle_without_pool"]
    return free // s["block_bytes"], engine.backend.block_size, as_twin(engine.backend).latency


def report(run: Path) -> list[str]:
    doc, got = load_matrix(run)
    top, block, latency = largest_pool(doc.get("twin_sensors", "ideal"))  # the run's own sensors
    seed = load_matrix(MATRIX_DIR / "seed-static_64.json")[1]
    lines = [
        f"Run: `{run.relative_to(ROOT) if run.is_relative_to(ROOT) else run}`; seed-static at 64 blocks from "
        "`bench/results/matrix/seed-static_64.json`. Bounds in output tokens/s (bench/kv_pool_bound.py says how).",
        f"Largest pool any policy can hold on the card: {top} blocks of {block} tokens.",
        "",
        "| con | in | out | pool ran (peak) | bound at that pool | adaptive | share of bound "
        f"| bound at {top} blocks / seed-static | adaptive / seed-static |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    wanted, best = [], []
    for point, p in got.items():
        pool = p.get("kv_pool_peak_blocks", 64)  # a JSON without the field ran on the 64-block pool
        n = num_requests(point)
        ran, ceiling = point_bound(latency, point, n, pool, block), point_bound(latency, point, n, top, block)
        s = seed[point]["output_throughput"]
        lines.append(
            f"| {point[0]} | {point[1]} | {point[2]} | {pool} | {ran:.1f} | {p['output_throughput']:.1f} "
            f"| {p['output_throughput'] / ran:.3f} | {ceiling / s:.3f} | {p['output_throughput'] / s:.3f} |"
        )
        if point[2] == 4096 and point[0] >= 4:
            wanted.append(p["output_throughput"] / s)
            best.append(ceiling / s)
    lines += [
        "",
        f"Out=4096, con >= 4: geomean adaptive / seed-static {geomean(wanted):.3f}; geomean of the bound at the "
        f"largest pool / seed-static {geomean(best):.3f}.",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=MATRIX_DIR / "adaptive_sized.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    write_report(args.out, report(args.run.resolve()), Stamp("python -m bench.kv_pool_bound"))


if __name__ == "__main__":
    main()
