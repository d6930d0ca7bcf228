"""Another process takes 4 GiB of the twin's card mid-run and gives it back 2 minutes later.

Why: a hand-set pool either leaves that memory idle or OOMs when someone else needs it; the sized pool must
shrink before the step that would run out, lose no request, and grow back once the memory is free again.

The run, in virtual time on the default twin (sized pool, adaptive): closed-loop clients keep sending
requests until `--duration`, then the run drains. At `--take-at` the other process asks for `--take-gib`;
like a real one it gets only what the driver has free (TwinBackend.set_external) and retries before every
step until it holds all of it. At `--take-at + --hold` it lets go. Every step records the pool, NVML's used
bytes, what the other process holds and the capacity; the PNG plots them over time.

    python -m bench.external_memory --out bench/results/external_memory.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.report import Stamp, write_report
from bench.harness.twin_flags import add_twin_sensors, twin_argv
from engine.backends.twin.backend import as_twin
from engine.cli import engine_config
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from telemetry.record import StepRecord
from telemetry.units import GIB


@dataclass
class Timeline:
    """One row per engine step, as the step left the device."""

    t: list[float] = field(default_factory=list)
    pool: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    timeline: Timeline
    capacity: int
    sent: int = 0
    finished: int = 0
    ooms: int = 0
    # (time, blocks before, blocks after) of every resize, and the first time the other process held it all
    resizes: list[tuple[float, int, int]] = field(default_factory=list)
    held_all_at: float | None = None
    pool_preemptions: int = 0  # running requests preempted so the pool could shrink below the blocks in use
    takes: int = 0  # times the other process got more memory
    shrunk_after_take: int = 0  # ... and the very next step began by shrinking the pool


def run(
    concurrency: int,
    input_len: int,
    output_len: int,
    duration: float,
    take_at: float,
    hold: float,
    take: int,
    twin: list[str],
) -> Outcome:
    engine = build_engine(engine_config(twin))
    backend = as_twin(engine.backend)
    out = Outcome(Timeline(), backend.memory.cuda_total)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)

    def send() -> None:
        engine.add_request(f"r{out.sent}", [1 + (out.sent + j) % 1000 for j in range(input_len)], params)
        out.sent += 1

    def record(rec: StepRecord, _batch: object) -> None:
        tl = out.timeline
        tl.t.append(backend.now())
        tl.pool.append(engine.allocator.num_blocks * backend.block_bytes)
        tl.used.append(rec.memory.device_used or 0)
        tl.external.append(backend.memory.external)

    engine.step_listeners.append(record)
    for _ in range(concurrency):
        send()
    while engine.has_unfinished():
        now = backend.now()
        wanted = take if take_at <= now < take_at + hold else 0
        took = backend.memory.external != wanted and _take(engine, wanted, out)
        out.takes += took
        blocks = engine.allocator.num_blocks
        done = [o for o in engine.step() if o.finish_reason is not None]
        if engine.allocator.num_blocks != blocks:
            out.resizes.append((now, blocks, engine.allocator.num_blocks))
            out.shrunk_after_take += took and engine.allocator.num_blocks < blocks
        out.finished += sum(s.finish_reason == "length" for s in done)
        for _ in done:
            if backend.now() < duration:
                send()
    out.ooms = engine.ooms
    out.pool_preemptions = engine.policy.state()["counters"]["kv_pool_preemptions"]
    return out


def _take(engine: LLMEngine, wanted: int, out: Outcome) -> bool:
    """The other process asks for `wanted` bytes in all; True when it now holds more than before."""
    backend = as_twin(engine.backend)
    before = backend.memory.external
    held = backend.set_external(wanted)
    if held == wanted and wanted and out.held_all_at is None:
        out.held_all_at = backend.now()
    return held > before


def plot(out: Outcome, path: Path, take_at: float, hold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = out.timeline
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(tl.t, [u / GIB for u in tl.used], label="used (NVML)", lw=1)
    ax.plot(tl.t, [p / GIB for p in tl.pool], label="KV pool", lw=1.5)
    ax.plot(tl.t, [e / GIB for e in tl.external], label="other process", lw=1)
    ax.axhline(out.capacity / GIB, color="k", ls="--", lw=1, label="capacity")
    ax.axvspan(take_at, take_at + hold, color="grey", alpha=0.15, label="other process asks for memory")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("GiB")
    ax.set_title("Twin (RTX 4090 + Llama-3.1-8B): the sized KV pool when another process takes memory")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--duration", type=float, default=300.0, help="virtual seconds during which clients send")
    ap.add_argument("--take-at", type=float, default=60.0)
    ap.add_argument("--hold", type=float, default=120.0)
    ap.add_argument("--take-gib", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=None, help="markdown report; the PNG goes beside it")
    ap.add_argument("--no-plot", action="store_true", help="leave the PNG as it is (needs no matplotlib)")
    add_twin_sensors(ap)
    a = ap.parse_args()
    stamp = Stamp("python -m bench.external_memory")
    take = int(a.take_gib * GIB)
    out = run(a.concurrency, a.input_len, a.output_len, a.duration, a.take_at, a.hold, take, twin_argv(a))
    tl = out.timeline
    during = [p for t, p in zip(tl.t, tl.pool, strict=True) if a.take_at <= t < a.take_at + a.hold]
    lines = [
        "# External memory on the twin",
        "",
        f"{a.concurrency} closed-loop "
        f"clients, {a.input_len}-token prompts, {a.output_len} output tokens, sending for {a.duration:.0f} s of "
        f"virtual time; another process asks for {a.take_gib:g} GiB at {a.take_at:.0f} s and lets go at "
        f"{a.take_at + a.hold:.0f} s.",
        "",
        f"- requests: {out.sent} sent, {out.finished} finished, {out.sent - out.finished} lost; OOMs: {out.ooms}",
        f"- the other process held all {a.take_gib:g} GiB from "
        + (f"{out.held_all_at:.1f} s" if out.held_all_at is not None else "never"),
        f"- the other process got more memory {out.takes} times; the next step began with a pool shrink "
        f"{out.shrunk_after_take} times (otherwise the pool was already down to the blocks in use and the "
        "budget bounded the step)",
        f"- requests preempted (recompute, newest first) so the pool could shrink below the blocks in use: "
        f"{out.pool_preemptions}",
        f"- pool: {tl.pool[0] / GIB:.2f} GiB at the start, {min(during, default=0) / GIB:.2f} GiB at least while "
        f"the memory was taken, {tl.pool[-1] / GIB:.2f} GiB at the end; {len(out.resizes)} resizes",
        "- resizes (virtual s: blocks before -> after): "
        + ", ".join(f"{t:.1f}: {a_} -> {b}" for t, a_, b in out.resizes[:40])
        + (" ..." if len(out.resizes) > 40 else ""),
    ]
    if a.out:
        png = a.out.with_suffix(".png")
        if not a.no_plot:
            plot(out, png, a.take_at, a.hold)
        lines += ["", f"![pool, used memory and capacity over time]({png.name})"]
    write_report(a.out, lines, stamp)


if __name__ == "__main__":
    main()
