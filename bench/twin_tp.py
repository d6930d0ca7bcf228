"""Tensor parallelism on the twin (#28): the seed matrix at --tensor-parallel-size 2 (two RTX 4090s on PCIe 4.0,
no NVLink) against one card, both with the pool the controller sizes and realistic sensors. Targets: 30/30 points,
0 failed, 0 OOMs at TP=2; the report shows, point by point, the KV capacity and the output tok/s against TP=1.

It reads the two matrix runs (`headroom bench matrix --backend twin --policy adaptive --jobs 1`, without and with
`--tensor-parallel-size 2`; bench/experiments.py registers both) and writes the comparison."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.harness.report import Stamp, write_report
from bench.seed_matrix import MATRIX_DIR, geomean, load_matrix
from engine.backends.twin.profile import load_profile
from telemetry.units import MIB


def hypotheses() -> list[str]:
    """The [tensor_parallel] constants the TP=2 numbers rest on, as the profile states them."""
    tp = load_profile().section("tensor_parallel")
    return [
        f"- all-reduce: two a layer of [tokens, 4096] bf16, a ring over PCIe through host memory (no peer access on "
        f"GeForce cards): bus bandwidth {tp['allreduce_bus_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"{tp['allreduce_latency_s'] * 1e6:.0f} us each; NCCL's buffers {tp['nccl_bytes'] / MIB:.0f} MiB a card. "
        "Hypotheses, with their sources in the profile's [tensor_parallel]; not measured on two 4090s.",
        "- kernels: the sharded ops (" + ", ".join(tp["sharded_ops"]) + ") and attention at 1/2 of their table time "
        "(half the weights or heads: half the bytes and FLOPs); norms and embedding whole; the LM head, its logits "
        "and the sampler on rank 0 only (engine/backends/twin/tensor_parallel.py).",
    ]


def report(tp1: Path, tp2: Path) -> list[str]:
    (doc1, one), (doc2, two) = load_matrix(tp1), load_matrix(tp2)
    if doc1.get("twin_sensors") != doc2.get("twin_sensors"):
        raise SystemExit(f"{tp1} and {tp2} must use the same sensors")
    block_tokens = int(doc1["block_size"])
    card_block = load_profile().section("model")["kv_bytes_per_token"] * block_tokens
    ratio = {k: two[k]["output_throughput"] / one[k]["output_throughput"] for k in one}
    failed, ooms = sum(p["failed"] for p in two.values()), sum(p["ooms"] for p in two.values())
    mean = geomean(ratio.values())
    low, high = min(ratio, key=ratio.get), max(ratio, key=ratio.get)
    holds = len(two) == 30 and failed + ooms == 0
    lines = [
        "# Tensor parallelism on the twin: the seed matrix at TP=2 against TP=1 (issue #28)",
        "",
        f"Twin numbers, virtual time, {doc2['twin_sensors']} sensors, adaptive with the pool it sizes (by the tightest "
        "rank at TP=2). TP=1 is one RTX 4090; TP=2 is two, each holding half of every layer and of every KV block.",
        "",
        f"- TP=1: `{doc1['command']}`",
        f"- TP=2: `{doc2['command']}`",
        "",
        *hypotheses(),
        "",
        "| target | result | holds |",
        "|---|---|---|",
        f"| 30/30 points, 0 failed, 0 OOMs at TP=2 | {len(two)} points, failed {failed}, OOMs {ooms} "
        f"| {'yes' if holds else 'NO'} |",
        "",
        f"Output tok/s TP=2 / TP=1: geometric mean {mean:.2f}x; lowest {ratio[low]:.2f}x at {low}; highest "
        f"{ratio[high]:.2f}x at {high}.",
        "",
        "KV capacity: the largest pool a point ran with, in tokens, and in MiB on each card (a TP=2 block holds half "
        f"the heads: {card_block // 2 // MIB} MiB a card, against {card_block // MIB} MiB).",
        "",
        "| con | in | out | KV tokens TP=1 | KV tokens TP=2 | MiB a card TP=1 / TP=2 | tok/s TP=1 | tok/s TP=2 "
        "| TP=2 / TP=1 | TPOT ms TP=1 / TP=2 | TTFT ms TP=1 / TP=2 | failed / OOMs TP=2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, x in ratio.items():
        a, b = one[k], two[k]
        blocks1, blocks2 = a["kv_pool_peak_blocks"], b["kv_pool_peak_blocks"]
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {blocks1 * block_tokens} | {blocks2 * block_tokens} "
            f"| {blocks1 * card_block // MIB} / {blocks2 * card_block // 2 // MIB} "
            f"| {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | {x:.2f} "
            f"| {a['mean_tpot_ms']:.1f} / {b['mean_tpot_ms']:.1f} | {a['mean_ttft_ms']:.0f} / {b['mean_ttft_ms']:.0f} "
            f"| {b['failed']} / {b['ooms']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, run in (("--tp1", "adaptive_sized_realistic"), ("--tp2", "adaptive_sized_realistic_tp2")):
        ap.add_argument(flag, type=Path, default=MATRIX_DIR / f"{run}.json", help=f"default: the {run} matrix run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    write_report(args.out, report(args.tp1, args.tp2), Stamp("python -m bench.twin_tp", argv))


if __name__ == "__main__":
    main()
