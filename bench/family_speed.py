"""Decode tok/s of a Qwen2-shaped model against a Llama-shaped one of the same size on the CPU kernels, as a ratio
measured in one run; target: Qwen2 within 10% of Llama.

The two differ only in Qwen2's q/k/v biases (SmolLM2-135M's shape for both, random weights, float weights in the
CPU's `--dtype auto` dtype, the C++ kernels and the one-call layers: engine/model/cpu_forward.py), so the ratio
is what the bias costs the one-call layers. Each measurement is a fresh process that builds one model and times
the median of `--steps` decode steps (bench/bench_engine.py `bench_decode`, every sequence holding `--context`
tokens of KV) at batch 1 and 8: within one process a model built later decodes measurably faster than one built
before it (it follows where its packed weights were placed: packing them again moves it), which would decide the
ratio by build order. The families
alternate over `--rounds` rounds, each first in every other round, so a neighbour's burst on the shared machine
falls on both; the ratio is Qwen2's tok/s over Llama's in the same round, reported as the mean over rounds with
its spread (min and max).

    python -m bench.family_speed [--rounds 8] [--out bench/results/family_speed.md]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from typing import Any

import torch

from bench.bench_engine import bench_decode
from bench.harness.machine import load_average, machine_line
from bench.harness.report import ROOT, Stamp, write_report
from engine.backends.torch_backend import TorchBackend
from engine.model.dtype_choice import AUTO, choose_dtype
from engine.model.loaders.random_model import random_llama
from engine.model.model_config import ModelConfig

SHAPE = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 9,
    "num_kv_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip
FAMILIES = {"llama": {}, "qwen2": {"attention_bias": True}}
BATCHES = (1, 8)
TARGET = 0.9  # Qwen2's tok/s over Llama's, at least
BLOCK = 16


def measure(family: str, context: int, steps: int) -> dict[str, Any]:
    """One family's decode tok/s at each batch size, in this process, with its dtype and kernels."""
    cfg = ModelConfig(**SHAPE, **FAMILIES[family])
    dtype = choose_dtype(AUTO, torch.device("cpu")).dtype
    blocks = max(BATCHES) * -(-(context + steps + 2) // BLOCK) + 8
    backend = TorchBackend(random_llama(cfg, dtype, "cpu", name=family), dtype=AUTO, device="cpu",
                           quantization="none", num_blocks=blocks, block_size=BLOCK)  # fmt: skip
    if backend.model.fused is None:
        raise RuntimeError(f"{family}: the decoder layers do not run as one C++ call here ({backend.kernel_reason})")
    rng = random.Random(0)
    bench_decode(backend, 1, context, 2, rng)  # warm: the first steps
    tok_s = {batch: bench_decode(backend, batch, context, steps, rng)[0] for batch in BATCHES}
    return {"tok_s": tok_s, "dtype": str(dtype).removeprefix("torch."), "kernels": backend.kernel_reason}


def in_fresh_process(family: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.family_speed", "--measure", family, "--steps", str(args.steps),
           "--context", str(args.context)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, machine: str) -> list[str]:
    tok_s = {f: {b: [run["tok_s"][str(b)] for run in runs[f]] for b in BATCHES} for f in FAMILIES}
    ratios = {b: [q / ll for q, ll in zip(tok_s["qwen2"][b], tok_s["llama"][b], strict=True)] for b in BATCHES}
    first = runs["llama"][0]
    lines = [
        "# Decode tok/s, Qwen2 (q/k/v biases) against Llama of the same shape, on the CPU kernels",
        "",
        machine,
        "",
        f"SmolLM2-135M's shape for both (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, intermediate "
        f"1536, vocab 49152, tied embeddings), Qwen2 with q/k/v biases; random weights, {first['dtype']} "
        f"(`--dtype auto`), no quantization; kernels: {first['kernels']}. {args.rounds} alternating rounds, each "
        f"family's a fresh process timing the median of {args.steps} decode steps with {args.context} tokens of KV "
        "per sequence.",
        "",
        "| batch | Llama tok/s (mean) | Qwen2 tok/s (mean) | Qwen2 / Llama, mean | min | max |",
        "|---|---|---|---|---|---|",
    ]
    for b in BATCHES:
        r = ratios[b]
        lines.append(
            f"| {b} | {statistics.mean(tok_s['llama'][b]):.1f} | {statistics.mean(tok_s['qwen2'][b]):.1f} | "
            f"**{statistics.mean(r):.3f}** | {min(r):.3f} | {max(r):.3f} |"
        )
    verdict = "met" if min(statistics.mean(r) for r in ratios.values()) >= TARGET else "missed"
    return [
        *lines,
        "",
        f"Target: Qwen2 at least {TARGET}x Llama's tok/s at each batch: {verdict}. Wall time on a machine shared "
        "with other processes (the load average is above): the spread of a round's ratio is as much theirs as the "
        "models'.",
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch and measurement")
    ap.add_argument("--context", type=int, default=256, help="tokens of KV each decoding sequence holds")
    ap.add_argument("--measure", choices=FAMILIES, help="(internal) measure this family and print it as JSON")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.context, args.steps)))
        return
    stamp, load_before = Stamp("python -m bench.family_speed", argv), load_average()
    runs: dict[str, list[dict[str, Any]]] = {family: [] for family in FAMILIES}
    for r in range(args.rounds):
        for family in sorted(FAMILIES, reverse=r % 2 == 1):  # each family first in every other round
            runs[family].append(in_fresh_process(family, args))
    data = {"shape": SHAPE, "families": FAMILIES, "steps": args.steps, "context": args.context, "runs": runs}
    write_report(args.out, report(runs, args, machine_line(load_before)), stamp, data)


if __name__ == "__main__":
    main()
