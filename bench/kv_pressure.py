"""Where the time goes at a KV-bound point: one twin run, step by step, set against its physical bound.

Why: the out=4096 points reach well short of the bound for the pool they ran with
(bench/results/kv_pool_bound.md). That bound assumes a full pool every step and free recomputes, so the gap
is made of steps where the pool is not full (the start, the tail), decode steps lost to recompute
prefills, and thrashing. This script measures each of those at a point:
- decode batch: the time-weighted mean decode batch, and the bound's (n x out / its decode steps);
- pool use: the mean share of the pool that running sequences hold during decode steps;
- recompute: steps that recompute a preempted sequence's tokens, those tokens, and the seconds of those
  steps (the whole step: a recompute chunk shares it with decodes);
- waiting: seconds requests spend between arrival and first token, and preempted requests out of KV;
- tail: seconds at the end with fewer than `con` / 4 sequences decoding (the last requests running alone);
- thrashing: preemptions per request, and the largest number for one request.

    python -m bench.kv_pressure --points "16,32,4096;64,256,4096" --out /tmp/kv_pressure.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from bench.cli import parse_points
from bench.harness.report import Stamp, write_report
from bench.kv_pool_bound import point_bound
from bench.loadgen import run_closed_loop
from bench.seed_matrix import num_requests
from engine.backends.twin.backend import as_twin
from engine.cli import add_config_flags, config_from_args
from engine.config import EngineConfig
from engine.core.batch import SchedulerOutput
from engine.core.sequence import Sequence
from engine.factory import build_engine
from telemetry.record import StepRecord


@dataclass
class StepLog:
    """Per-step sums, filled by the engine's step listener."""

    pool: int = 0  # the largest pool seen
    seconds: float = 0.0
    decode_seconds: float = 0.0  # steps with at least one decode
    batch_seconds: float = 0.0  # sum of decode batch x step seconds
    used_seconds: float = 0.0  # sum of used / total blocks x step seconds, over decode steps
    recompute_steps: int = 0
    recompute_tokens: int = 0
    recompute_seconds: float = 0.0
    prefill_seconds: float = 0.0  # steps with any prefill
    timeline: list[tuple[float, float, int]] = field(default_factory=list)  # (start, seconds, decode batch)
    requests: dict[str, Sequence] = field(default_factory=dict)  # the engine's unfinished requests
    known: dict[str, Sequence] = field(default_factory=dict)  # every request seen in a step, finished ones too

    def __call__(self, record: StepRecord, batch: SchedulerOutput) -> None:
        d, decodes = record.duration, record.shape.decode_seqs
        self.pool = max(self.pool, record.kv_blocks_total)
        self.seconds += d
        self.timeline.append((record.time, d, decodes))
        if decodes:
            self.decode_seconds += d
            self.batch_seconds += decodes * d
            self.used_seconds += record.kv_blocks_used / record.kv_blocks_total * d
        if record.shape.prefill_tokens:
            self.prefill_seconds += d
        # a preempted sequence's prefill chunks recompute what it had (prompt and output) until it decodes
        seqs = [self.known.setdefault(it.request_id, self.requests.get(it.request_id)) for it in batch.items]
        redo = sum(
            it.num_tokens
            for it, seq in zip(batch.items, seqs, strict=True)
            if it.is_prefill and seq is not None and seq.num_preemptions
        )
        if redo > 0:
            self.recompute_steps += 1
            self.recompute_tokens += redo
            self.recompute_seconds += d

    def tail_seconds(self, below: int) -> float:
        """Seconds at the end of the run during which fewer than `below` sequences decoded."""
        total = 0.0
        for _, d, decodes in reversed(self.timeline):
            if decodes >= below:
                break
            total += d
        return total


def measure(cfg: EngineConfig, point: tuple[int, int, int]) -> dict[str, float]:
    con, inp, out = point
    n = num_requests(point)
    engine = build_engine(cfg)
    log = StepLog(requests=engine.requests)
    engine.step_listeners.append(log)
    run = run_closed_loop(engine, con, n, inp, out, fast=False)
    seqs = run.sequences
    pre = [s.num_preemptions for s in seqs]
    bound = point_bound(as_twin(engine.backend).latency, point, n, log.pool, engine.allocator.block_size)
    return {
        "tok/s": n * out / run.duration,
        "bound tok/s": bound,
        "share of bound": n * out / run.duration / bound,
        "pool (peak blocks)": log.pool,
        "seconds": run.duration,
        "steps": run.steps,
        "mean decode batch (time-weighted)": log.batch_seconds / log.decode_seconds,
        "mean pool use in decode steps": log.used_seconds / log.decode_seconds,
        "seconds of steps with a prefill": log.prefill_seconds,
        "recompute steps": log.recompute_steps,
        "recomputed tokens": log.recompute_tokens,
        "recompute step seconds": log.recompute_seconds,
        "mean seconds to first token": sum(s.first_token_time - s.arrival_time for s in seqs) / len(seqs),
        "tail seconds (fewer than con / 4 decoding)": log.tail_seconds(max(1, con // 4)),
        "preemptions": sum(pre),
        "requests preempted": sum(p > 0 for p in pre),
        "most preemptions of one request": max(pre),
    }


def report(cfg: EngineConfig, points: list[tuple[int, int, int]]) -> tuple[list[str], dict]:
    results = {f"{c},{i},{o}": measure(cfg, (c, i, o)) for c, i, o in points}
    keys = list(next(iter(results.values())))
    lines = [
        f"Twin, policy {cfg.policy}, num_blocks {cfg.num_blocks or 'sized by the controller'}.",
        "",
        "| measure | " + " | ".join(f"({p})" for p in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for k in keys:
        cells = [f"{v:.3f}" if isinstance(v := r[k], float) else str(v) for r in results.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=parse_points, default=parse_points("16,32,4096;64,256,4096"))
    ap.add_argument("--out", default=None)
    add_config_flags(ap, EngineConfig)
    args = ap.parse_args()
    cfg = config_from_args(ap, EngineConfig, args)
    if cfg.backend != "twin":
        ap.error("the twin only: the bound is the twin's")
    lines, data = report(cfg, args.points)
    write_report(args.out, lines, Stamp("python -m bench.kv_pressure"), data)


if __name__ == "__main__":
    main()
