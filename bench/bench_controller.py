"""Cost of the adaptive controller's decision per engine step (budget: 100 us on the CPU it runs on).

One step = step_budget() + the scheduler's fit calls through a Packer (one fit_decodes for the running sequences, a
fit_chunk per prompt chunk) + observe(record, cuts). Synthetic records from a plant like the 4090 twin's (0.5 MiB per
token through lm_head, 40 MiB per prompt), every step sampled (the worst case for the probe side).
Prints a markdown table; --out writes it to a file.

    python -m bench.bench_controller --steps 20000 --out bench/results/controller_decision.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from controller.adaptive import AdaptivePolicy
from controller.step_budget import Packer
from telemetry.record import MemorySample, StepRecord, StepShape
from telemetry.units import MIB

# CPU time of this process, not wall time: the cost is what the controller burns, and on a shared
# machine wall time also counts whatever else ran meanwhile.
CLOCK = time.process_time_ns
CAPACITY = 25_250_627_584
IDLE = 22_190_000_000


def make_record(step: int, shape: StepShape, rng: random.Random) -> StepRecord:
    peak = (2 + 0.49 * (shape.prefill_tokens + shape.decode_seqs) + 40 * shape.prefill_seqs) * MIB
    peak *= 1 + 0.01 * rng.random()
    mem = MemorySample(
        peak_allocated=int(IDLE + peak),
        reserved=int(IDLE + peak + 50 * MIB),
        idle_baseline=IDLE,
        capacity=CAPACITY,
        device_used=int(IDLE + peak + 450 * MIB),
        device_total=25_757_220_864,
    )
    return StepRecord(step, 0.0, 0.02, shape, mem, 40, 24, 64, preempted=0, num_running=shape.decode_seqs)


def one_step(pol: AdaptivePolicy, decodes: int, chunks: int, rng: random.Random, step: int) -> tuple[int, StepRecord]:
    """The policy calls of one step, timed; returns (ns, record to observe next)."""
    t0 = CLOCK()
    packer = Packer(pol.step_budget())
    lim = packer.budget.limits
    shape = StepShape()
    n = packer.decodes(shape, [1000] * decodes)  # the scheduler builds this list anyway
    shape.decode_seqs += n
    shape.sum_context += 1000 * n
    shape.sampled_seqs += n
    for _ in range(chunks):
        c = packer.chunk(shape, 0, min(2048, max(1, lim.max_prefill_tokens - shape.prefill_tokens)))
        if not c:
            break
        shape.prefill_tokens += c
        shape.prefill_seqs += 1
        shape.sum_context += c
        shape.prefill_attn += c * c
        shape.sampled_seqs += 1
    t1 = CLOCK()
    rec = make_record(step, shape, rng)
    t2 = CLOCK()
    pol.observe(rec, packer.cuts())
    t3 = CLOCK()
    return (t1 - t0) + (t3 - t2), rec


def run(decodes: int, chunks: int, steps: int, prefill_every: int) -> dict[str, float]:
    rng = random.Random(0)
    pol = AdaptivePolicy()
    times = []
    for step in range(1, steps + 1):
        ns, _ = one_step(pol, decodes, chunks if step % prefill_every == 0 else 0, rng, step)
        if step > steps // 10:  # skip the warm-up
            times.append(ns / 1000)
    times.sort()
    return {
        "mean": statistics.fmean(times),
        "p50": times[len(times) // 2],
        "p99": times[int(0.99 * len(times))],
        "max": times[-1],
    }


def parts(steps: int) -> dict[str, float]:
    """Per-call costs of the pieces (us)."""
    rng = random.Random(1)
    pol = AdaptivePolicy()
    for step in range(1, 200):
        one_step(pol, 16, 1, rng, step)
    shape = StepShape(decode_seqs=16, sum_context=16000, sampled_seqs=16)
    n = steps
    contexts = [1000] * 32
    budget = pol.step_budget()
    t = CLOCK()
    for _ in range(n):
        budget.fit_decodes(shape, contexts)
    fd = (CLOCK() - t) / n / 1000
    t = CLOCK()
    for _ in range(n):
        budget.fit_chunk(shape, 512, 4096)
    fc = (CLOCK() - t) / n / 1000
    t = CLOCK()
    for _ in range(n):
        pol.step_budget()
    li = (CLOCK() - t) / n / 1000
    recs = [
        make_record(
            200 + k,
            StepShape(
                prefill_tokens=512,
                prefill_seqs=1,
                decode_seqs=16,
                sum_context=16512,
                prefill_attn=512 * 512,
                sampled_seqs=17,
            ),
            rng,
        )
        for k in range(n)
    ]
    t = CLOCK()
    for r in recs:
        pol.observe(r)
    ob = (CLOCK() - t) / n / 1000
    return {"fit_decodes (32 candidates)": fd, "fit_chunk": fc, "step_budget": li, "observe": ob}


def python_speed() -> float:
    """ns per iteration of an empty Python loop: how fast this CPU runs Python, for comparison."""
    n = 2_000_000
    t = CLOCK()
    for _ in range(n):
        pass
    return (CLOCK() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp, load_before = Stamp("python -m bench.bench_controller"), load_average()
    cases = [
        ("observe + limits + 2 decodes + 2 fit_chunk", 2, 2, 1),
        ("decode 32, no prefill", 32, 0, 1),
        ("decode 32 + 2 chunks every step", 32, 2, 1),
        ("decode 64 + 1 chunk every 8th step", 64, 1, 8),
        ("decode 128 + 4 chunks every step", 128, 4, 1),
    ]
    lines = [
        "# Controller decision cost per engine step",
        "",
        "One step = step_budget() + one fit_decodes over the running sequences + fit_chunk per prompt chunk + "
        "observe(record, cuts), every record sampled (the two estimators run RLS on a surprise, else at least every "
        "8th step; the other steps still update residuals, budget, law and KV ratio). "
        "Times are CPU time of the process (time.process_time_ns), so load from other processes on the "
        "machine does not count.",
        "",
        "| step | mean us | p50 us | p99 us | max us |",
        "|---|---|---|---|---|",
    ]
    for name, d, c, every in cases:
        r = run(d, c, args.steps, every)
        lines.append(f"| {name} | {r['mean']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} |")
    p = parts(args.steps)
    lines += [
        "",
        "Per call (us): " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()),
        "",
        f"Python speed here: {python_speed():.0f} ns per empty loop iteration (a current desktop core: ~10-20).",
        "",
        "Budget: 100 us per step. Everything but fit_chunk is paid once per step; fit_decodes checks all "
        "decode candidates with one sum when they all fit, so only building the context list grows with the "
        "batch.",
        "",
        machine_line(load_before),
    ]
    write_report(args.out, lines, stamp)


if __name__ == "__main__":
    main()
