"""Workload shift on the 4090 twin (virtual time): short chat, a burst of 8192-token prompts, short chat.

Open loop, seeded: 2 minutes of chat (Poisson arrivals, short prompts and outputs), then a burst of
8192-token prompts (chat keeps arriving beside it), then 2 minutes of chat again. The adaptive policy
runs with its default config. Every step records the controller's signals as they stand for the next
step, and the step's measured peak against the budget it was packed under.

How each criterion is measured (all on the twin, so all numbers are twin numbers):
- shifts: the step the first long prompt is scheduled, and the step after the last one finishes;
- settling, per signal: the limits memory sets (budget scale; effective prefill limit = the prompt
  tokens memory and cap admit into an empty step; memory decode limit = the decodes of 1024 tokens memory
  admits into an empty step) and, reported beside them, the trust-region caps (prefill and decode),
  which follow demand. The final value of a phase is the median of its last third; the signal has
  settled at the first step after which it stays within +-10 % of that value to the end of the phase.
  Target: within 50 steps of each shift;
- oscillation: a reversal is a move of more than 2 % of the phase's final value in the opposite
  direction of the previous such move. The signal oscillates if any 50-step window after settling holds
  3 or more reversals;
- memory use under steady high load: on settled burst steps that admission cut (a chunk shortened or
  work deferred for memory), live bytes at the step's peak above the idle floor over the device budget
  above it (capacity - external - idle - headroom). Target: median at least 85 %.

    python -m bench.workload_shift --out bench/results/workload_shift.md
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from bench.harness.report import Stamp, write_report
from bench.harness.twin_flags import add_twin_sensors, twin_argv
from bench.loadgen import RunResult, TraceRequest, run_trace
from engine.cli import engine_config
from engine.core.batch import SchedulerOutput
from engine.core.llm_engine import LLMEngine
from engine.factory import build_engine
from telemetry.record import StepRecord
from telemetry.units import MIB

# The limits memory sets (judged for settling and oscillation) and the trust-region caps, which follow
# demand (in slow start a cap is 2x the largest batch that ran cleanly: it moves when demand reaches a
# new high, not when memory changes); reported beside them.
MEMORY_SIGNALS = ("scale", "effective_prefill", "memory_decode_seqs")
SIGNALS = (*MEMORY_SIGNALS, "prefill_cap", "decode_cap")
DECODE_CONTEXT = 1024  # reference context of memory_decode_seqs
SETTLE_BAND, SETTLE_TARGET = 0.10, 50
REVERSAL_MOVE, REVERSAL_WINDOW, REVERSALS_MAX = 0.02, 50, 3


def workload(seed: int, chat_s: float, chat_rate: float, burst: int, burst_rate: float) -> list[TraceRequest]:
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []

    def poisson(start: float, end: float, rate: float, make: object) -> None:
        t = start + rng.expovariate(rate)
        while t < end:
            reqs.append(make(t))  # type: ignore[operator]
            t += rng.expovariate(rate)

    def chat(t: float) -> TraceRequest:
        return TraceRequest(rng.randint(32, 512), rng.randint(16, 256), t)

    burst_end = chat_s + burst / burst_rate
    poisson(0.0, chat_s, chat_rate, chat)
    for i in range(burst):
        reqs.append(TraceRequest(8192, rng.randint(64, 256), chat_s + i / burst_rate))
    poisson(chat_s, 2 * chat_s + burst_end - chat_s, chat_rate, chat)
    return sorted(reqs, key=lambda r: r.arrival_time)


class Recorder:
    """Per step: the shape, the peak, the budget it was packed under, and the signals after observe()."""

    def __init__(self, engine: object) -> None:
        self.pol = engine.policy  # type: ignore[attr-defined]
        self.rows: list[dict[str, float]] = []
        self._budget = self._budget_now()
        self._cuts = self._cut_count()

    def _budget_now(self) -> tuple[float, float, int]:
        """(scale x usable MiB, room MiB, idle floor): usable is what admission packs the step's own peak
        against; room = capacity - external - idle - headroom is the device budget above the idle floor,
        which the step's peak plus what the previous step retained must fit."""
        b = self.pol.memory.budget.budget
        if not b.known:
            return float("inf"), float("inf"), 0
        return self.pol.law.scale * b.usable / MIB, (b.free + b.retained - b.headroom) / MIB, b.idle

    def _cut_count(self) -> int:
        c = self.pol.counters
        return c.chunks + c.deferrals

    def __call__(self, rec: StepRecord, batch: SchedulerOutput) -> None:
        pol, cuts = self.pol, self._cut_count()
        long_prefill = any(it.is_prefill and len(it.prompt_ids) >= 8192 for it in batch.items)
        usable, room, idle = self._budget
        m = rec.memory
        self.rows.append(
            {
                "step": rec.step_id,
                "time": rec.time,
                "prefill_tokens": rec.shape.prefill_tokens,
                "decode_seqs": rec.shape.decode_seqs,
                "long_prefill": long_prefill,
                "oom": rec.oom,
                "peak_mib": m.step_peak / MIB if m.sampled else None,
                "allocated_mib": (m.peak_allocated - idle) / MIB if m.sampled else None,
                "reserved_mib": (m.reserved - idle) / MIB if m.sampled else None,
                "usable_mib": usable,
                "room_mib": room,
                "cut": cuts > self._cuts,
                "scale": pol.law.scale,
                "prefill_cap": pol.law.prefill_cap,
                "decode_cap": pol.law.decode_cap,
                "effective_prefill": pol.effective_prefill_tokens(),
                "memory_decode_seqs": pol.memory_decode_seqs(DECODE_CONTEXT),
            }
        )
        self._budget, self._cuts = self._budget_now(), cuts


def settle(values: list[float]) -> tuple[float, int]:
    """(final value, index from which the signal stays within the band of it)."""
    final = statistics.median(values[-max(1, len(values) // 3) :])
    band = SETTLE_BAND * abs(final) if final else SETTLE_BAND
    k = len(values)
    while k > 0 and abs(values[k - 1] - final) <= band:
        k -= 1
    return final, k


def max_reversals(values: list[float], final: float) -> int:
    """Most reversals (see the module docstring) inside any REVERSAL_WINDOW steps."""
    move = REVERSAL_MOVE * abs(final) if final else REVERSAL_MOVE
    at: list[int] = []
    last_sign = 0
    for i in range(1, len(values)):
        d = values[i] - values[i - 1]
        if abs(d) <= move:
            continue
        sign = 1 if d > 0 else -1
        if last_sign and sign != last_sign:
            at.append(i)
        last_sign = sign
    best, lo = 0, 0
    for hi in range(len(at)):
        while at[hi] - at[lo] >= REVERSAL_WINDOW:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def analyse(rows: list[dict], shifts: list[int]) -> dict:
    bounds = [0, *shifts, len(rows)]
    phases = []
    for p in range(len(bounds) - 1):
        seg = rows[bounds[p] : bounds[p + 1]]
        sig = {}
        for name in SIGNALS:
            vals = [float(r[name]) for r in seg]
            final, k = settle(vals)
            sig[name] = {
                "final": final,
                "settle_steps": k,
                "max_reversals_50": max_reversals(vals[k:], final),
                "min": min(vals),
                "max": max(vals),
            }
        phases.append({"first_step": seg[0]["step"], "steps": len(seg), "signals": sig})
    burst = rows[shifts[0] : shifts[1]]
    settled = max(phases[1]["signals"][n]["settle_steps"] for n in MEMORY_SIGNALS)
    high = [r for r in burst[settled:] if r["cut"] and r["peak_mib"] is not None and 0 < r["room_mib"] < float("inf")]
    ratios = {
        "reserved / room": [r["reserved_mib"] / r["room_mib"] for r in high],
        "allocated / room": [r["allocated_mib"] / r["room_mib"] for r in high],
        "step peak / usable": [r["peak_mib"] / r["usable_mib"] for r in high],
    }
    return {
        "phases": phases,
        "ooms": sum(r["oom"] for r in rows),
        "high_load_steps": len(high),
        "high_load": {
            k: {"median": statistics.median(v), "p10": sorted(v)[len(v) // 10], "max": max(v)}
            for k, v in ratios.items()
            if v
        },
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-seconds", type=float, default=120.0)
    ap.add_argument("--chat-rate", type=float, default=4.0, help="chat requests per second")
    ap.add_argument("--burst", type=int, default=16, help="8192-token prompts in the burst")
    ap.add_argument("--burst-rate", type=float, default=2.0, help="their arrivals per second")
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=64,
        help="KV blocks: the seed's hand-set 64 keep prefills memory-bound, the regime this run studies; 0 lets "
        "the controller size the pool (its reserve then keeps the burst's prefills clear of the budget)",
    )
    ap.add_argument(
        "--out", default=None, help="markdown report; the summary and the steps around each shift go beside it as .json"
    )
    add_twin_sensors(ap)
    return ap.parse_args()


@dataclass
class Shift:
    """One run of the workload: what the report reads."""

    reqs: list[TraceRequest]
    engine: LLMEngine
    run: RunResult
    rows: list[dict]
    shifts: list[int]  # the first long prefill's step and the step after the last long request finished
    res: dict


def run_shift(args: argparse.Namespace) -> Shift:
    reqs = workload(args.seed, args.chat_seconds, args.chat_rate, args.burst, args.burst_rate)
    argv = [*twin_argv(args), "--policy", "adaptive"]
    if args.num_blocks:
        argv += ["--num-blocks", str(args.num_blocks)]
    engine = build_engine(engine_config(argv))
    rec = Recorder(engine)
    engine.step_listeners.append(rec)
    run = run_trace(engine, reqs)
    rows = rec.rows
    long_steps = [i for i, r in enumerate(rows) if r["long_prefill"]]
    long_done = max(s.token_times[-1] for s in run.sequences if s.prompt_len >= 8192)
    after = next(i for i, r in enumerate(rows) if r["time"] >= long_done)
    shifts = [long_steps[0], after]
    return Shift(reqs, engine, run, rows, shifts, analyse(rows, shifts))


def report(args: argparse.Namespace, sh: Shift) -> list[str]:
    reqs, engine, run, rows, shifts, res = sh.reqs, sh.engine, sh.run, sh.rows, sh.shifts, sh.res
    ok = [s for s in run.sequences if s.finish_reason in ("length", "stop")]
    exact = all(len(s.output_ids) == s.max_tokens for s in ok)
    lines = [
        "# Workload shift on the 4090 twin (twin numbers, virtual time)",
        "",
        f"Workload (seed {args.seed}): chat for {args.chat_seconds:.0f} s at {args.chat_rate}/s (prompts 32-512, "
        f"outputs 16-256 tokens); then {args.burst} prompts of 8192 tokens at {args.burst_rate}/s (outputs "
        f"64-256) while chat continues; then chat for {args.chat_seconds:.0f} s more. Policy adaptive, default "
        f"config, KV blocks {engine.allocator.num_blocks}.",
        "",
        f"- requests: {len(reqs)} sent, {len(ok)} completed, {run.num_requests - len(ok)} failed, "
        f"every one with exactly its max_tokens: {exact}",
        f"- OOMs: {res['ooms']}; steps: {len(rows)}; virtual duration {run.duration:.1f} s",
        f"- shifts at steps {rows[shifts[0]]['step']} (first 8192-token prefill) and {rows[shifts[1]]['step']} "
        "(the last long request finished)",
        "",
        "Settling (steps from the phase start until the signal stays within 10 % of its final value) and "
        "oscillation (most reversals of > 2 % in any 50 steps after settling; 3 or more = oscillating):",
        "",
        "| phase | signal | final | min | max | settle steps | max reversals / 50 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    names = ["chat", "burst", "chat again"]
    for name, ph in zip(names, res["phases"], strict=True):
        for s, v in ph["signals"].items():
            lines.append(
                f"| {name} (from step {ph['first_step']}, {ph['steps']} steps) | {s} | {v['final']:.3g} | "
                f"{v['min']:.3g} | {v['max']:.3g} | {v['settle_steps']} | {v['max_reversals_50']} |"
            )
    h = res["high_load"]
    lines += [
        "",
        f"Steady high load: the {res['high_load_steps']} settled burst steps that admission cut for "
        "memory. allocated / room is the measure: live bytes at the step's peak above the idle floor "
        "(the step's own peak plus what the previous step retained), over the device budget above that "
        "floor (capacity - external - idle - headroom). reserved / room adds the allocator's cached "
        "segments (it can pass 1: the cache may reach into the headroom); step peak / usable is the "
        "step's own peak over the budget admission packed it against.",
        "",
        "| ratio | median | p10 | max |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {v['median']:.3f} | {v['p10']:.3f} | {v['max']:.3f} |" for k, v in h.items()] + [""]
    return lines + criteria(res, run.num_requests == len(ok))


def criteria(res: dict, none_failed: bool) -> list[str]:
    h = res["high_load"]
    checks = [
        ("0 OOMs", res["ooms"] == 0),
        ("0 failed requests", none_failed),
        (
            "memory limits settle within 50 steps of each shift",
            all(ph["signals"][s]["settle_steps"] <= SETTLE_TARGET for ph in res["phases"][1:] for s in MEMORY_SIGNALS),
        ),
        (
            "caps settle within 50 steps of each shift (they follow demand)",
            all(
                ph["signals"][s]["settle_steps"] <= SETTLE_TARGET
                for ph in res["phases"][1:]
                for s in SIGNALS
                if s not in MEMORY_SIGNALS
            ),
        ),
        (
            "no oscillation, any signal",
            all(v["max_reversals_50"] < REVERSALS_MAX for ph in res["phases"] for v in ph["signals"].values()),
        ),
        (
            "peak >= 85% of budget in steady high load (median allocated / room)",
            bool(h) and h["allocated / room"]["median"] >= 0.85,
        ),
    ]
    return ["| criterion | holds |", "|---|---|"] + [f"| {c} | {'yes' if ok_ else 'NO'} |" for c, ok_ in checks]


def main() -> None:
    args = parse_args()
    stamp = Stamp("python -m bench.workload_shift")
    sh = run_shift(args)
    near = [sh.rows[max(0, s - 50) : s + 200] for s in sh.shifts]  # the whole series is ~4 MB: keep the transients
    write_report(args.out, report(args, sh), stamp, {"summary": sh.res, "steps_around_shifts": near})


if __name__ == "__main__":
    main()
