"""Step time at tensor-parallel size 2 against size 1 on this CPU, as a ratio measured in one run.

Both engines (a tiny random Llama, tests/fixtures_llama.py: 4 query heads, 2 KV heads, float32, the same
greedy load) are built first and then run the same load in alternating rounds, so a neighbour's burst on the
shared machine falls on both. Each round adds `--requests` prompts and runs them to the end; every step's
duration is kept with its kind (a step with prompt tokens, or a decode-only step). The result is the ratio of
the medians, TP=2 over TP=1, by kind, and whether the greedy tokens were equal.

On a small CPU tensor parallelism is not expected to be faster: the ranks share the host's cores (one OpenMP
thread each on 2 cores, against two for TP=1: the bench sets the driver process's count before each
engine's round) and each step adds two all-reduces a layer over gloo (TCP on
loopback) and a message to every worker. What it buys is memory per rank, not speed here.

    python -m bench.tp_cpu --out bench/results/tp_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from tests.fixtures_llama import build_tiny_llama


def run_round(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[tuple[str, float]]]:
    """The prompts to the end: every request's tokens and every step's (kind, seconds)."""
    steps: list[tuple[str, float]] = []
    listener = lambda record, _batch: steps.append(  # noqa: E731 - one line, removed below
        ("prefill" if record.shape.prefill_tokens else "decode", record.duration)
    )
    engine.step_listeners.append(listener)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.step_listeners.remove(listener)
    return tokens, steps


def measure(model: Path, rounds: int, requests: int, max_tokens: int) -> dict:
    engines = {
        size: build_engine(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=size))
        for size in (1, 2)
    }
    prompts = [[5 + i % 200, 17, 33 + i % 100, 40, 9] * (1 + i % 8) for i in range(requests)]
    times: dict[int, dict[str, list[float]]] = {size: {"prefill": [], "decode": []} for size in engines}
    equal = True
    try:
        for _ in range(rounds):
            answers = {}
            for size, engine in engines.items():
                # torch's thread count is the process's: the driver's rank set it to its share of the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
                answers[size], steps = run_round(engine, prompts, max_tokens)
                for kind, seconds in steps:
                    times[size][kind].append(seconds)
            equal = equal and answers[1] == answers[2]
    finally:
        engines[2].backend.close()
    medians = {size: {k: statistics.median(v) for k, v in by.items()} for size, by in times.items()}
    fastest = {size: {k: min(v) for k, v in by.items()} for size, by in times.items()}
    return {
        "rounds": rounds,
        "requests": requests,
        "max_tokens": max_tokens,
        "steps": {size: {k: len(v) for k, v in by.items()} for size, by in times.items()},
        "median_step_s": medians,
        "min_step_s": fastest,
        "ratio": {k: medians[2][k] / medians[1][k] for k in ("prefill", "decode")},
        "ratio_of_minima": {k: fastest[2][k] / fastest[1][k] for k in ("prefill", "decode")},
        "tokens_equal": equal,
    }


def report(data: dict, machine: str) -> list[str]:
    med, low, steps = data["median_step_s"], data["min_step_s"], data["steps"]
    rows = [
        f"| {kind} | {steps[1][kind]} / {steps[2][kind]} | {med[1][kind] * 1e3:.2f} | {med[2][kind] * 1e3:.2f} "
        f"| **{data['ratio'][kind]:.2f}x** | {low[1][kind] * 1e3:.2f} | {low[2][kind] * 1e3:.2f} "
        f"| {data['ratio_of_minima'][kind]:.2f}x |"
        for kind in ("prefill", "decode")
    ]
    return [
        "# Tensor parallelism on the CPU: step time at TP=2 against TP=1 (issue #28)",
        "",
        f"A tiny random Llama (2 layers, hidden 64, 4 query heads, 2 KV heads; tests/fixtures_llama.py), float32, "
        f"gloo on loopback. {data['rounds']} alternating rounds of {data['requests']} requests (prompts of 5-40 "
        f"tokens, {data['max_tokens']} greedy tokens each), policy adaptive. Greedy tokens equal at TP=2 and TP=1 "
        f"in every round: {'yes' if data['tokens_equal'] else 'NO'}.",
        "",
        "| step kind | steps TP=1 / TP=2 | median ms TP=1 | median ms TP=2 | TP=2 / TP=1 (medians) "
        "| min ms TP=1 | min ms TP=2 | TP=2 / TP=1 (minima) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Wall time on a shared 2-core machine (the load average is below): each rank runs one OpenMP thread, and "
        "every step adds two all-reduces a layer and the driver's message to the worker. On this tiny model the "
        "step is mostly that fixed cost, so the ratio says what the machinery costs, not what a large model on "
        "GPUs would gain.",
        "",
        machine,
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stamp, before = Stamp("python -m bench.tp_cpu", argv), load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp)).hf_dir
        data = measure(model, args.rounds, args.requests, args.max_tokens)
    write_report(args.out, report(data, machine_line(before)), stamp, data)


if __name__ == "__main__":
    main()
