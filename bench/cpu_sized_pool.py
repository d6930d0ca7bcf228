"""The controller-sized KV pool on the real CPU engine: the default model against an emulated
1 GiB device, no --num-blocks.

Why: the twin shows the sizing in a model; this runs the same start-up profiling and online rule on the
real torch engine, where every tracked step that crosses the emulated capacity raises the emulated OOM.
Every step is tracked (sample_every 1), so nothing runs unchecked. 64 requests with mixed prompt lengths
are added at once; the run reports the pool the controller sized, the resizes it made, the emulated OOMs,
and the measured cost of one resize (a grow by `--resize-blocks` and the shrink back, timed on the engine's
own resize path between steps).

    python -m bench.cpu_sized_pool --out bench/results/cpu_sized_pool.md
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from engine.cli import engine_config
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from telemetry.units import MIB

VOCAB_LOW, VOCAB_HIGH = 100, 49_000  # ordinary token ids of SmolLM2's vocabulary


@dataclass
class Outcome:
    sizing: dict
    dtype: str
    requests: int
    prompt_tokens: int
    finished: int = 0
    ooms: int = 0
    emulated_ooms: int = 0
    steps: int = 0
    untracked_steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    resizes: list[tuple[int, int, int]] = field(default_factory=list)  # (step, blocks before, after)
    resize_cost: list[tuple[int, int, float]] = field(default_factory=list)  # (before, after, seconds)


def build(device_memory: str, dtype: str) -> LLMEngine:
    argv = ["--backend", "torch", "--device", "cpu", "--device-memory", device_memory, "--dtype", dtype]
    engine = build_engine(engine_config([*argv, "--policy", "adaptive"]))
    probe = engine.backend.probe
    probe.sample_every, probe.overhead_budget = 1, None  # track every step: every step can OOM
    return engine


def run(engine: LLMEngine, requests: int, min_prompt: int, max_prompt: int, max_tokens: int, seed: int = 0) -> Outcome:
    """Add `requests` prompts of uniform random length in [min_prompt, max_prompt] at once; step to the end."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_prompt, max_prompt) for _ in range(requests)]
    sizing = engine.policy.state()["kv_pool"]["start_up"] or {}
    out = Outcome(sizing, str(engine.backend.dtype).removeprefix("torch."), requests, sum(lengths))
    for i, n in enumerate(lengths):
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True, temperature=0.0)
        engine.add_request(f"r{i}", [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)], params)
    probe = engine.backend.probe
    steps0, sampled0 = probe.steps, probe.sampled_steps  # the start-up profiling steps ran before this run
    start = time.perf_counter()
    while engine.has_unfinished() and engine.healthy:
        blocks = engine.allocator.num_blocks
        out.finished += sum(o.finish_reason == "length" for o in engine.step())
        if engine.allocator.num_blocks != blocks:
            out.resizes.append((engine.step_id, blocks, engine.allocator.num_blocks))
    out.seconds = time.perf_counter() - start
    out.ooms, out.emulated_ooms = engine.ooms, probe.ooms
    out.steps = probe.steps - steps0
    out.untracked_steps = out.steps - (probe.sampled_steps - sampled0)
    out.preemptions = engine.scheduler.num_preemptions
    return out


def time_resizes(engine: LLMEngine, blocks: int) -> list[tuple[int, int, float]]:
    """Grow the idle pool by `blocks` and shrink it back, each timed on the engine's resize path."""
    costs = []
    for delta in (blocks, -blocks):
        old = engine.allocator.num_blocks
        start = time.perf_counter()
        engine.resize_kv_pool(old + delta)
        costs.append((old, engine.allocator.num_blocks, time.perf_counter() - start))
    return costs


def report(out: Outcome, args: argparse.Namespace) -> list[str]:
    s = out.sizing
    lines = [
        "# The sized KV pool on the CPU engine",
        "",
        f"SmolLM2-135M (default model, {out.dtype}), "
        f"`--device-memory {args.device_memory}`, policy adaptive, no `--num-blocks`; every step tracked "
        f"(sample_every 1), so each step that would cross the emulated capacity raises the emulated OOM.",
        f"{out.requests} requests added at once, prompts uniform in [{args.min_prompt}, {args.max_prompt}] tokens "
        f"({out.prompt_tokens} in all), max_tokens uniform in [1, {args.max_tokens}], seed {args.seed}.",
        "",
        "## The sized pool (start-up profiling steps)",
        "",
        f"- {s.get('num_blocks')} blocks of {s.get('block_bytes', 0) / MIB:.3f} MiB = "
        f"{s.get('num_blocks', 0) * s.get('block_bytes', 0) / MIB:.0f} MiB",
        f"- capacity {s.get('capacity', 0) / MIB:.0f} MiB; idle without the pool "
        f"{s.get('idle_without_pool', 0) / MIB:.0f} MiB; reserve {s.get('reserve', 0) / MIB:.0f} MiB "
        f"(the most of {s.get('profile_steps')} profiling steps: a {s.get('profiled_tokens')}-token prefill twice, "
        f"then a decode batch); headroom "
        f"{s.get('headroom', 0) / MIB:.0f} MiB; outside {s.get('external', 0) / MIB:.0f} MiB",
        "",
        "## The run",
        "",
        f"- finished {out.finished}/{out.requests}; engine OOMs {out.ooms}; emulated OOMs {out.emulated_ooms}",
        f"- {out.steps} steps ({out.untracked_steps} untracked), {out.preemptions} preemptions, "
        f"{out.seconds:.1f} s wall",
        f"- online resizes: {len(out.resizes)}" + "".join(f"; step {st}: {a} -> {b}" for st, a, b in out.resizes),
        "",
        "## Cost of one resize (idle pool, after the run)",
        "",
        "| blocks before | after | seconds |",
        "|---|---|---|",
        *(f"| {a} | {b} | {sec:.3f} |" for a, b, sec in out.resize_cost),
        "",
        "Measured once each on a shared 2-core machine; the reallocation and copy of every layer's K and V.",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-memory", default="1GiB")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--resize-blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    stamp = Stamp("python -m bench.cpu_sized_pool")
    load_before = load_average()
    engine = build(a.device_memory, a.dtype)
    out = run(engine, a.requests, a.min_prompt, a.max_prompt, a.max_tokens, a.seed)
    out.resize_cost = time_resizes(engine, a.resize_blocks)
    write_report(a.out, [*report(out, a), "", machine_line(load_before)], stamp, out.__dict__)


if __name__ == "__main__":
    main()
